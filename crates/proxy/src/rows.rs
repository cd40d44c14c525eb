//! Router rows (`router.csv`, docs/CONTRACTS.md, "Rows": `schema::RouterRow`, written through its
//! serde definition; the columns are `schema::ROUTER_COLUMNS`), written off the request path.
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
pub use schema::RouterRow;

/// Rows queued but not yet written when the queue is full are dropped (and counted).
pub const DEFAULT_QUEUE_ROWS: usize = 1 << 16;

enum Msg {
    Row(Box<RouterRow>),
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
        // The header is the schema's list, written once; rows follow it (`RouterRow`'s fields are
        // those columns, in order).
        let mut w = csv::WriterBuilder::new()
            .has_headers(false)
            .from_writer(BufWriter::with_capacity(1 << 16, file));
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
    pub fn send(&self, row: RouterRow) {
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
    let write = |w: &mut csv::Writer<BufWriter<File>>, row: &RouterRow| match w.serialize(row) {
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

    /// `router.csv` in a fresh temp dir, removed when the returned guard drops.
    fn tmp(name: &str) -> (test_support::TempDir, std::path::PathBuf) {
        let dir = test_support::temp_dir(&format!("proxy-rows-{name}"));
        let path = dir.path().join("router.csv");
        (dir, path)
    }

    #[test]
    fn rows_round_trip_with_header_and_empty_cells() {
        let (_dir, path) = tmp("rt");
        let sink = RowSink::create(&path, 16).unwrap();
        sink.send(RouterRow {
            request_id: "r1".into(),
            session_id: Some("s,1".into()),
            arrival_s: 1.5,
            policy: "round-robin".into(),
            replica: Some(2),
            branch: Some("rr".into()),
            upstream_status: Some(200),
            cached_tokens: Some(16),
            prompt_tokens: Some(20),
            attempts: 1,
            ..RouterRow::default()
        });
        sink.close();
        sink.send(RouterRow::default());
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
        sink.send(RouterRow::default());
        assert_eq!(sink.stats().dropped.load(Ordering::Relaxed), 0);
        let (_dir, path) = tmp("many");
        let sink = RowSink::create(&path, 1).unwrap();
        for i in 0..1000 {
            sink.send(RouterRow {
                request_id: format!("r{i}"),
                ..RouterRow::default()
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
