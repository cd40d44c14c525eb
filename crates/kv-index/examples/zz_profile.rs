use kv_index::hash::byte_block_keys;
use kv_index::{IndexConfig, Matches, PrefixIndex};
fn main() {
    let mode = std::env::args().nth(1).unwrap_or_default();
    let nconv: usize = std::env::args().nth(2).map_or(782, |s| s.parse().unwrap());
    let n: usize = std::env::args().nth(3).map_or(200_000, |s| s.parse().unwrap());
    let mut x = 7u64;
    let mut rnd = || { x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407); (x >> 33) as u8 };
    let mut chain = |n: usize| { let b: Vec<u8> = (0..n*64).map(|_| rnd()).collect(); byte_block_keys(b"m", &b, 64) };
    let mut convs = vec![];
    for _ in 0..nconv { convs.push(chain(128)); }
    let mut idx = PrefixIndex::new(IndexConfig { node_cap: 100_000, ..Default::default() }).unwrap();
    for (r, c) in convs.iter().enumerate() { idx.insert(r as u32 % 5, c, 0).unwrap(); }
    let mut m = Matches::new();
    let t = std::time::Instant::now();
    let mut y = 1u64;
    for i in 0..n {
        y = y.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let c = &convs[(y >> 33) as usize % convs.len()];
        if mode == "lookup" { idx.lookup(c, 1, &mut m); } else {
        idx.lookup_insert(c, 1 + i as u64, &mut m, |m| Some((m.hits().first().map_or(0, |h| h.0), false))).unwrap(); }
    }
    println!("{mode} {:.2} us ({} nodes)", t.elapsed().as_secs_f64() * 1e6 / n as f64, idx.len());
}
