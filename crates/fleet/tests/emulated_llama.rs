//! The emulated twin of the llama fleet (`--fleet emulated --cache-model llama-slots`): emulated
//! replicas started with the llama fleet's pinned slot settings and the llama-tiny step model
//! report llama.cpp's cache shape (one `-c` pool of 1-token cells), record the cache model in
//! meta, and, like llama-server, publish no KV events: exact residency is refused before the
//! router starts, and a replica asked for events is refused before it is spawned.
//!
//! Builds the engine release binary first (a no-op when fresh). 0.2 s once built; ignored by
//! default: `cargo test -p fleet --test emulated_llama -- --include-ignored`.

use std::path::PathBuf;
use std::time::Duration;

use fleet::fleet::never;
use fleet::ingress::router::check_fleet_kv_events;
use fleet::{EmulatedCache, EmulatedSpec, Fleet, FleetOptions, RouterSettings, Source};

use test_support::release_bin;

fn spec(engine_bin: PathBuf, kv_events: bool) -> EmulatedSpec {
    EmulatedSpec {
        engine_bin,
        replicas: 2,
        speed: 1.0,
        slowdowns: vec![],
        num_gpu_blocks: None,
        model: "kvroute/tiny".into(),
        seed: 1,
        kv_events,
        extra_args: vec![],
        cache: EmulatedCache::llama_fleet(),
    }
}

#[test]
#[ignore = "needs the release binaries: cargo build --release"]
fn an_emulated_llama_fleet_has_the_llama_fleets_slots_and_no_kv_events() {
    let engine = release_bin("engine");
    let dir = test_support::temp_dir("fleet-test-emulated-llama");
    let options = FleetOptions {
        ready_timeout: Duration::from_secs(60),
        ..FleetOptions::new(dir.path().join("logs"))
    };
    let mut fleet = Fleet::new(Source::Emulated(spec(engine.clone(), false)), options).unwrap();
    fleet.start(&never).unwrap();
    // llama.cpp's cache shape, as the real fleet reads it from /props: -c cells of one token.
    for i in 0..2 {
        let cache = fleet.kv_cache(i).expect("the emulator reports its cache");
        assert_eq!((cache.block_size_tokens, cache.num_gpu_blocks), (1, 16384));
    }
    let meta = fleet.engine_meta();
    assert_eq!(meta["cache_model"], "llama-slots");
    assert_eq!(meta["parallel_slots"], 4);
    assert_eq!(meta["slot_prompt_similarity"], 0.1);
    assert_eq!(meta["step_model"], "llama-tiny");
    // The replica's own log records its command line with the flags.
    let log = std::fs::read_to_string(dir.path().join("logs").join("replica-0.log")).unwrap();
    assert!(
        log.contains(
            "--cache-model llama-slots --parallel-slots 4 --slot-prompt-similarity 0.1 --ctx-tokens 16384 --step-model llama-tiny"
        ),
        "{log}"
    );
    // Exact residency is refused before a router starts.
    let e = check_fleet_kv_events(
        &fleet,
        &RouterSettings {
            policy: "exact-residency".into(),
            model: "kvroute/tiny".into(),
            kv_events: true,
            ..RouterSettings::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.starts_with(
            "policy exact-residency needs the engines' KV events and cannot run on a llama-slots emulated fleet: the emulator's llama-slots cache model publishes no KV events"
        ),
        "{e}"
    );
    assert!(
        check_fleet_kv_events(
            &fleet,
            &RouterSettings {
                policy: "prefix-affinity".into(),
                model: "kvroute/tiny".into(),
                ..RouterSettings::default()
            },
        )
        .is_ok()
    );
    fleet.stop();
    // Replicas asked for events are refused before any process starts.
    let mut asked = Fleet::new(
        Source::Emulated(spec(engine, true)),
        FleetOptions::new(dir.path().join("logs2")),
    )
    .unwrap();
    let e = format!("{:#}", asked.start(&never).unwrap_err());
    assert!(
        e.contains("KV events were asked of an emulated fleet that has none"),
        "{e}"
    );
}
