//! Router rows (`router.csv`, DESIGN.md §3.7; the columns are `schema::ROUTER_COLUMNS`), written
//! off the request path.
//!
//! Request tasks hand finished rows to a bounded channel with `try_send` (never blocking a
//! stream); a dedicated OS thread owns the file, drains the queue every 20 ms and flushes every
//! 200 ms and on close, so a crash loses at most the last fraction of a second. A row that cannot
//! be queued or written is counted (`dropped`), never silently lost.

use std::fs::File;
use std::io::BufWriter;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError, TrySendError, sync_channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use schema::ROUTER_COLUMNS;

/// Rows queued but not yet written when the queue is full are dropped (and counted).
pub const DEFAULT_QUEUE_ROWS: usize = 1 << 16;

/// One router row. `None` renders as an empty cell (not applicable / unknown).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Row {
    /// `x-request-id` (received or generated).
    pub request_id: String,
    /// Session id (`x-session-id`, else the body's `user`).
    pub session_id: Option<String>,
    /// Seconds since the router's monotonic start when the request arrived.
    pub arrival_s: f64,
    /// Policy name.
    pub policy: String,
    /// The replica that served the request (after retries).
    pub replica: Option<u32>,
    /// Decision branch (`Branch::as_str`).
    pub branch: Option<&'static str>,
    /// Tokens the policy predicted were cached on the chosen replica.
    pub predicted_match_tokens: Option<u32>,
    /// Outstanding requests of the chosen replica at decision time (before the increment).
    pub outstanding_chosen: Option<u32>,
    /// Outstanding requests of the least-loaded eligible replica at decision time.
    pub outstanding_min: Option<u32>,
    /// Time inside `Policy::decide`, nanoseconds (last attempt).
    pub decide_ns: Option<u64>,
    /// Router overhead: arrival → upstream request written, plus upstream first byte → client
    /// first byte, minus any tokenize round trip.
    pub overhead_us: Option<u64>,
    /// Tokenize round trip (exact residency), milliseconds.
    pub tokenize_ms: Option<f64>,
    /// Upstream HTTP status (the router's own status when it answered itself; `None` when no
    /// head came back and nobody got an answer: the client went away or shutdown cut it).
    pub upstream_status: Option<u16>,
    /// `usage.prompt_tokens_details.cached_tokens` from the response.
    pub cached_tokens: Option<u64>,
    /// `usage.prompt_tokens` from the response.
    pub prompt_tokens: Option<u64>,
    /// Empty on success, else `kind: message` (kinds in docs/CONTRACTS.md, "Rows").
    pub error: Option<String>,
    /// Upstream attempts made (0 when no replica was tried).
    pub attempts: u32,
}

impl Row {
    /// Writes the row's fields, in [`ROUTER_COLUMNS`] order.
    fn write_to(
        &self,
        w: &mut csv::Writer<BufWriter<File>>,
        buf: &mut Vec<String>,
    ) -> csv::Result<()> {
        fn opt<T: ToString>(v: &Option<T>) -> String {
            v.as_ref().map(ToString::to_string).unwrap_or_default()
        }
        buf.clear();
        buf.push(self.request_id.clone());
        buf.push(self.session_id.clone().unwrap_or_default());
        buf.push(format!("{:.6}", self.arrival_s));
        buf.push(self.policy.clone());
        buf.push(opt(&self.replica));
        buf.push(self.branch.unwrap_or("").to_string());
        buf.push(opt(&self.predicted_match_tokens));
        buf.push(opt(&self.outstanding_chosen));
        buf.push(opt(&self.outstanding_min));
        buf.push(opt(&self.decide_ns));
        buf.push(opt(&self.overhead_us));
        buf.push(
            self.tokenize_ms
                .map(|v| format!("{v:.3}"))
                .unwrap_or_default(),
        );
        buf.push(opt(&self.upstream_status));
        buf.push(opt(&self.cached_tokens));
        buf.push(opt(&self.prompt_tokens));
        buf.push(self.error.clone().unwrap_or_default());
        buf.push(self.attempts.to_string());
        w.write_record(buf.iter())
    }
}

enum Msg {
    Row(Box<Row>),
    Close,
}

/// Counters the writer exports in `/metrics`.
#[derive(Debug, Default)]
pub struct RowStats {
    /// Rows written to the file.
    pub written: AtomicU64,
    /// Rows that could not be queued or written.
    pub dropped: AtomicU64,
    /// Failed flushes of the file (rows written before one may be incomplete on disk).
    pub io_errors: AtomicU64,
}

/// Handle to the row writer thread. Cheap to share behind an `Arc`.
pub struct RowSink {
    tx: Option<SyncSender<Msg>>,
    stats: Arc<RowStats>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl RowSink {
    /// A sink that writes nothing (no `--rows`), but still counts.
    pub fn disabled() -> Self {
        RowSink {
            tx: None,
            stats: Arc::new(RowStats::default()),
            thread: Mutex::new(None),
        }
    }

    /// Creates (truncates) `path`, writes the header and starts the writer thread.
    pub fn create(path: &Path, queue_rows: usize) -> std::io::Result<Self> {
        let file = File::create(path)?;
        let mut w = csv::WriterBuilder::new().from_writer(BufWriter::with_capacity(1 << 16, file));
        w.write_record(ROUTER_COLUMNS)
            .map_err(std::io::Error::other)?;
        w.flush()?;
        let (tx, rx) = sync_channel(queue_rows.max(1));
        let stats = Arc::new(RowStats::default());
        let thread_stats = stats.clone();
        let thread = std::thread::Builder::new()
            .name("router-rows".into())
            .spawn(move || writer_loop(w, rx, &thread_stats))?;
        Ok(RowSink {
            tx: Some(tx),
            stats,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Queues a row without blocking; a full queue or a closed writer counts it as dropped.
    pub fn send(&self, row: Row) {
        let Some(tx) = &self.tx else { return };
        match tx.try_send(Msg::Row(Box::new(row))) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                self.stats.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Counters.
    pub fn stats(&self) -> &RowStats {
        &self.stats
    }

    /// Writes everything queued so far, flushes and stops the writer. Rows sent afterwards are
    /// counted as dropped. Idempotent.
    pub fn close(&self) {
        let Some(handle) = self.thread.lock().take() else {
            return;
        };
        if let Some(tx) = &self.tx {
            // A blocking send: the writer drains the queue, so this waits only for queued rows.
            let _ = tx.send(Msg::Close);
        }
        handle.thread().unpark();
        let _ = handle.join();
    }
}

impl Drop for RowSink {
    fn drop(&mut self) {
        self.close();
    }
}

/// How often the writer wakes to drain the queue. Senders never wake it: a wake-up per row cost
/// more CPU than the row itself.
const DRAIN_EVERY: Duration = Duration::from_millis(20);
/// How often written rows are flushed to the file (and on close).
const FLUSH_EVERY: Duration = Duration::from_millis(200);

fn writer_loop(mut w: csv::Writer<BufWriter<File>>, rx: Receiver<Msg>, stats: &RowStats) {
    let mut buf = Vec::with_capacity(ROUTER_COLUMNS.len());
    let mut write =
        |w: &mut csv::Writer<BufWriter<File>>, row: &Row| match row.write_to(w, &mut buf) {
            Ok(()) => stats.written.fetch_add(1, Ordering::Relaxed),
            Err(_) => stats.dropped.fetch_add(1, Ordering::Relaxed),
        };
    let flush = |w: &mut csv::Writer<BufWriter<File>>| {
        if w.flush().is_err() {
            stats.io_errors.fetch_add(1, Ordering::Relaxed);
        }
    };
    let mut last_flush = Instant::now();
    let mut dirty = false;
    loop {
        let mut closing = false;
        loop {
            match rx.try_recv() {
                Ok(Msg::Row(row)) => {
                    write(&mut w, &row);
                    dirty = true;
                }
                Ok(Msg::Close) | Err(TryRecvError::Disconnected) => {
                    closing = true;
                    break;
                }
                Err(TryRecvError::Empty) => break,
            }
        }
        if closing {
            // Rows queued behind Close (racing senders) are still written.
            while let Ok(Msg::Row(row)) = rx.try_recv() {
                write(&mut w, &row);
            }
            flush(&mut w);
            return;
        }
        if dirty && last_flush.elapsed() >= FLUSH_EVERY {
            flush(&mut w);
            dirty = false;
            last_flush = Instant::now();
        }
        std::thread::park_timeout(DRAIN_EVERY);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("proxy-rows-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir.join("router.csv")
    }

    #[test]
    fn rows_round_trip_with_header_and_empty_cells() {
        let path = tmp("rt");
        let sink = RowSink::create(&path, 16).unwrap();
        sink.send(Row {
            request_id: "r1".into(),
            session_id: Some("s,1".into()),
            arrival_s: 1.5,
            policy: "round-robin".into(),
            replica: Some(2),
            branch: Some("rr"),
            upstream_status: Some(200),
            cached_tokens: Some(16),
            prompt_tokens: Some(20),
            attempts: 1,
            ..Row::default()
        });
        sink.close();
        sink.send(Row::default());
        assert_eq!(sink.stats().written.load(Ordering::Relaxed), 1);
        assert_eq!(sink.stats().dropped.load(Ordering::Relaxed), 1);
        let mut rd = csv::Reader::from_path(&path).unwrap();
        assert_eq!(
            rd.headers().unwrap().iter().collect::<Vec<_>>(),
            ROUTER_COLUMNS.to_vec()
        );
        let recs: Vec<csv::StringRecord> = rd.records().map(Result::unwrap).collect();
        assert_eq!(recs.len(), 1);
        assert_eq!(&recs[0][0], "r1");
        assert_eq!(&recs[0][1], "s,1");
        assert_eq!(&recs[0][2], "1.500000");
        assert_eq!(&recs[0][4], "2");
        assert_eq!(&recs[0][6], "");
        assert_eq!(&recs[0][13], "16");
        assert_eq!(&recs[0][16], "1");
    }

    #[test]
    fn full_queue_counts_drops() {
        let sink = RowSink::disabled();
        sink.send(Row::default());
        assert_eq!(sink.stats().dropped.load(Ordering::Relaxed), 0);
        let path = tmp("many");
        let sink = RowSink::create(&path, 1).unwrap();
        for i in 0..1000 {
            sink.send(Row {
                request_id: format!("r{i}"),
                ..Row::default()
            });
        }
        sink.close();
        let st = sink.stats();
        let total = st.written.load(Ordering::Relaxed) + st.dropped.load(Ordering::Relaxed);
        assert_eq!(total, 1000);
        let lines = std::fs::read_to_string(&path).unwrap().lines().count() as u64;
        assert_eq!(lines, 1 + st.written.load(Ordering::Relaxed));
    }
}
