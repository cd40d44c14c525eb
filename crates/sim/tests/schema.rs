//! The simulator's rows must stay in the live schema: the same columns, in the same order, as the
//! driver's `client.csv` and the router's `router.csv`, so analysis and figures read both alike.

#[test]
fn client_columns_match_the_driver() {
    assert_eq!(sim::rows::CLIENT_COLUMNS, driver::rows::COLUMNS);
}

#[test]
fn router_columns_match_the_router() {
    assert_eq!(sim::rows::ROUTER_COLUMNS, proxy::rows::HEADER);
}
