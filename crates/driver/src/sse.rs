//! Incremental server-sent-events parser.
//!
//! Bytes arrive in arbitrary frames (an event may span several, a frame may hold several), so
//! the parser keeps the unfinished line and dispatches an event at each blank line, as the SSE
//! specification says. Only the fields an OpenAI stream uses are kept: `data` (multi-line data
//! joined with `\n`) and `event`; comments (`:` lines) and other fields are skipped.

/// One dispatched event.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SseEvent {
    /// The `event:` field, empty when absent (the default `message` type).
    pub event: String,
    /// The `data:` lines joined with `\n`.
    pub data: String,
}

/// Why the byte stream is not valid SSE.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SseError {
    /// A line grew beyond the limit without a line break.
    LineTooLong(usize),
    /// A line is not UTF-8.
    NotUtf8,
}

impl std::fmt::Display for SseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SseError::LineTooLong(n) => write!(f, "line longer than {n} bytes without a break"),
            SseError::NotUtf8 => write!(f, "line is not UTF-8"),
        }
    }
}

impl std::error::Error for SseError {}

/// Longest line accepted; OpenAI chunks are a few hundred bytes.
pub const MAX_LINE_BYTES: usize = 8 << 20;

/// The parser state: the unfinished line and the event being assembled.
#[derive(Debug, Default)]
pub struct SseParser {
    partial: Vec<u8>,
    current: SseEvent,
    has_data: bool,
    has_field: bool,
}

impl SseParser {
    /// A parser at the start of a stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds `bytes`; appends every event completed by them to `out`.
    pub fn push(&mut self, bytes: &[u8], out: &mut Vec<SseEvent>) -> Result<(), SseError> {
        let mut rest = bytes;
        while let Some(pos) = rest.iter().position(|&b| b == b'\n') {
            let (line, tail) = rest.split_at(pos);
            rest = &tail[1..];
            if self.partial.is_empty() {
                self.line(line, out)?;
            } else {
                self.partial.extend_from_slice(line);
                let joined = std::mem::take(&mut self.partial);
                self.line(&joined, out)?;
            }
        }
        if !rest.is_empty() {
            if self.partial.len() + rest.len() > MAX_LINE_BYTES {
                return Err(SseError::LineTooLong(MAX_LINE_BYTES));
            }
            self.partial.extend_from_slice(rest);
        }
        Ok(())
    }

    /// True when bytes of an unfinished event are buffered (the stream ended mid-event).
    pub fn has_pending(&self) -> bool {
        !self.partial.is_empty() || self.has_field
    }

    fn line(&mut self, line: &[u8], out: &mut Vec<SseEvent>) -> Result<(), SseError> {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.is_empty() {
            if self.has_data {
                out.push(std::mem::take(&mut self.current));
            } else {
                self.current = SseEvent::default();
            }
            self.has_data = false;
            self.has_field = false;
            return Ok(());
        }
        if line[0] == b':' {
            return Ok(());
        }
        let line = std::str::from_utf8(line).map_err(|_| SseError::NotUtf8)?;
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line, ""),
        };
        self.has_field = true;
        match field {
            "data" => {
                if self.has_data {
                    self.current.data.push('\n');
                }
                self.current.data.push_str(value);
                self.has_data = true;
            }
            "event" => self.current.event = value.to_owned(),
            _ => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_all(frames: &[&[u8]]) -> Vec<SseEvent> {
        let mut p = SseParser::new();
        let mut out = Vec::new();
        for f in frames {
            p.push(f, &mut out).unwrap();
        }
        out
    }

    #[test]
    fn events_split_across_frames_and_joined_in_one() {
        let whole = b"data: {\"a\":1}\n\ndata: [DONE]\n\n";
        let one = parse_all(&[whole]);
        assert_eq!(one.len(), 2);
        assert_eq!(one[0].data, "{\"a\":1}");
        assert_eq!(one[1].data, "[DONE]");
        // Every split point gives the same events.
        for i in 0..whole.len() {
            assert_eq!(parse_all(&[&whole[..i], &whole[i..]]), one, "split at {i}");
        }
    }

    #[test]
    fn crlf_comments_event_names_and_multiline_data() {
        let ev = parse_all(&[b": keep-alive\r\nevent: error\r\ndata: x\r\ndata:y\r\n\r\n"]);
        assert_eq!(
            ev,
            vec![SseEvent {
                event: "error".into(),
                data: "x\ny".into()
            }]
        );
    }

    #[test]
    fn blank_lines_without_data_dispatch_nothing() {
        assert!(parse_all(&[b"\n\n: c\n\nevent: x\n\n"]).is_empty());
        let mut p = SseParser::new();
        let mut out = Vec::new();
        p.push(b"data: partial", &mut out).unwrap();
        assert!(p.has_pending());
    }

    #[test]
    fn invalid_utf8_is_an_error() {
        let mut p = SseParser::new();
        let mut out = Vec::new();
        assert_eq!(p.push(b"data: \xff\n", &mut out), Err(SseError::NotUtf8));
    }
}
