//! One repetition directory: `meta.json` (written last, atomically) and the resume rule.

/// `meta.json` and the SLO and window it names: one definition for every writer and reader
/// (crates/schema).
pub use schema::{Meta, Slo, Window};

pub use experiment::cell::{CellState, clear, discard, measured_window, write_atomic, write_meta};

#[cfg(test)]
mod tests {
    use super::*;

    use crate::scratch::Scratch;

    fn meta(complete: bool, accepted: bool) -> Meta {
        Meta {
            sweep: "s".into(),
            point: "ws1-s0".into(),
            policy: "round-robin".into(),
            rep: 1,
            workload_name: "w".into(),
            workload_fingerprint: "f".into(),
            plan_fingerprint: "p".into(),
            fleet: serde_json::json!({"source": "emulated", "capacity_tokens": 1000}),
            slo: Slo {
                ttft_ms: 100.0,
                itl_ms: 3.0,
            },
            window: Window {
                warmup_s: 1.0,
                measured_start_s: 1.0,
                measured_end_s: 5.0,
            },
            git_rev: None,
            versions: serde_json::Value::Null,
            virtual_time: false,
            complete,
            accepted,
            set_aside_reason: (!accepted).then(|| "drift".to_string()),
            attempts: 1,
            evidence: serde_json::Value::Null,
            drift: serde_json::Value::Null,
            run: serde_json::Value::Null,
        }
    }

    #[test]
    fn meta_has_the_contract_fields_and_analysis_reads_it() {
        let s = Scratch::new("meta");
        write_meta(&s.0, &meta(true, false)).unwrap();
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(s.0.join("meta.json")).unwrap()).unwrap();
        for field in [
            "sweep",
            "point",
            "policy",
            "rep",
            "workload_name",
            "workload_fingerprint",
            "plan_fingerprint",
            "fleet",
            "slo",
            "window",
            "git_rev",
            "versions",
            "virtual",
            "complete",
            "accepted",
            "set_aside_reason",
        ] {
            assert!(v.get(field).is_some(), "meta.json lacks {field}");
        }
        let parsed = analysis::read_meta(&s.0.join("meta.json")).unwrap();
        assert!(!parsed.accepted);
        assert_eq!(parsed.capacity_tokens(), Some(1000));
        assert_eq!(parsed.window.measured_s(), 4.0);
    }
}
