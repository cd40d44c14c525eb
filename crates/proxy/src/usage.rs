//! Usage parsing in passing: the router reads `prompt_tokens`, `completion_tokens` (charged to
//! an API key's token limit, [`crate::keys`]) and `cached_tokens` from the response as it
//! streams through, without holding back or buffering the stream.
//!
//! For SSE, only the trailing partial event of a chunk is copied (so an event split across chunks
//! can still be read); complete events are scanned in place, and only an event that mentions
//! `"prompt_tokens"` is parsed as JSON. For a plain JSON response (non-streamed) a bounded copy
//! is kept and parsed at the end.

use serde::Deserialize;

/// Largest partial SSE event or JSON body the scanner copies; beyond it the usage is unknown.
const MAX_CARRY_BYTES: usize = 1 << 20;

/// Token counts from the final usage object.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// `usage.prompt_tokens`.
    pub prompt_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens`; `None` when the engine did not report it.
    pub cached_tokens: Option<u64>,
    /// `usage.completion_tokens`.
    pub completion_tokens: Option<u64>,
}

/// How the response body is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyKind {
    /// `text/event-stream`.
    Sse,
    /// `application/json`.
    Json,
    /// Anything else; not scanned.
    Other,
}

impl BodyKind {
    /// Classifies a `content-type` header value.
    pub fn from_content_type(ct: Option<&[u8]>) -> BodyKind {
        match ct {
            Some(v) if starts_with_ignore_case(v, b"text/event-stream") => BodyKind::Sse,
            Some(v) if starts_with_ignore_case(v, b"application/json") => BodyKind::Json,
            _ => BodyKind::Other,
        }
    }
}

fn starts_with_ignore_case(v: &[u8], prefix: &[u8]) -> bool {
    v.len() >= prefix.len() && v[..prefix.len()].eq_ignore_ascii_case(prefix)
}

/// Incremental usage scanner over one response body.
#[derive(Debug)]
pub struct UsageScanner {
    kind: BodyKind,
    carry: Vec<u8>,
    overflowed: bool,
    usage: Option<Usage>,
    done: bool,
}

#[derive(Deserialize)]
struct WithUsage {
    #[serde(default)]
    usage: Option<UsageJson>,
    /// llama.cpp's `timings` beside the usage (`cache_n`: prompt tokens read from the cache).
    #[serde(default)]
    timings: Option<Timings>,
}

#[derive(Deserialize)]
struct Timings {
    #[serde(default)]
    cache_n: Option<u64>,
}

#[derive(Deserialize)]
struct UsageJson {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens_details: Option<Details>,
}

#[derive(Deserialize)]
struct Details {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

impl UsageScanner {
    /// A scanner for a body of the given kind.
    pub fn new(kind: BodyKind) -> Self {
        UsageScanner {
            kind,
            carry: Vec::new(),
            overflowed: false,
            usage: None,
            done: false,
        }
    }

    /// The body kind this scanner was made for.
    pub fn kind(&self) -> BodyKind {
        self.kind
    }

    /// True when an SSE event has started but not yet ended (so an injected event must first
    /// terminate it).
    pub fn mid_event(&self) -> bool {
        self.kind == BodyKind::Sse && (!self.carry.is_empty() || self.overflowed)
    }

    /// Feeds the next body chunk.
    pub fn feed(&mut self, chunk: &[u8]) {
        match self.kind {
            BodyKind::Sse => self.feed_sse(chunk),
            BodyKind::Json => {
                if self.carry.len() + chunk.len() > MAX_CARRY_BYTES {
                    self.overflowed = true;
                    self.carry = Vec::new();
                } else if !self.overflowed {
                    self.carry.extend_from_slice(chunk);
                }
            }
            BodyKind::Other => {}
        }
    }

    /// Ends the body and returns the last usage seen, if any.
    pub fn finish(&mut self) -> Option<Usage> {
        if self.kind == BodyKind::Json && !self.overflowed && !self.carry.is_empty() {
            let body = std::mem::take(&mut self.carry);
            self.take_usage_from(&body);
        }
        self.usage
    }

    fn feed_sse(&mut self, chunk: &[u8]) {
        let mut start = 0;
        if !self.carry.is_empty() || self.overflowed {
            // The event boundary may straddle the previous chunk and this one.
            let tail = &self.carry[self.carry.len().saturating_sub(2)..];
            let mut joint = [0u8; 5];
            let head = &chunk[..chunk.len().min(3)];
            joint[..tail.len()].copy_from_slice(tail);
            joint[tail.len()..tail.len() + head.len()].copy_from_slice(head);
            let joint = &joint[..tail.len() + head.len()];
            let end = match find_boundary(joint) {
                Some((at, len)) if at + len > tail.len() && at < tail.len() => {
                    Some(at + len - tail.len())
                }
                _ => find_boundary(chunk).map(|(at, len)| at + len),
            };
            match end {
                Some(end) => {
                    if !self.overflowed {
                        self.carry.extend_from_slice(&chunk[..end]);
                        let ev = std::mem::take(&mut self.carry);
                        self.scan_event(&ev);
                        self.carry = ev;
                    }
                    self.carry.clear();
                    self.overflowed = false;
                    start = end;
                }
                None => {
                    if self.carry.len() + chunk.len() > MAX_CARRY_BYTES {
                        self.overflowed = true;
                        self.carry.clear();
                    } else if !self.overflowed {
                        self.carry.extend_from_slice(chunk);
                    }
                    return;
                }
            }
        }
        let mut rest = &chunk[start..];
        while let Some((at, len)) = find_boundary(rest) {
            self.scan_event(&rest[..at]);
            rest = &rest[at + len..];
        }
        if !rest.is_empty() {
            if rest.len() > MAX_CARRY_BYTES {
                self.overflowed = true;
            } else {
                self.carry.extend_from_slice(rest);
            }
        }
    }

    /// True once the SSE terminator `data: [DONE]` went through: the response is complete even
    /// if the client hangs up before the upstream's end of body.
    pub fn saw_done(&self) -> bool {
        self.done
    }

    fn scan_event(&mut self, event: &[u8]) {
        let end = event
            .iter()
            .rposition(|&b| b != b'\n' && b != b'\r')
            .map_or(0, |i| i + 1);
        let trimmed = &event[..end];
        if trimmed == b"data: [DONE]" || trimmed == b"data:[DONE]" {
            self.done = true;
            return;
        }
        if find(event, b"\"prompt_tokens\"").is_none() {
            return;
        }
        // An event is `data: <json>` lines; vLLM sends exactly one data line per event.
        for line in event.split(|&b| b == b'\n') {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            if let Some(data) = line.strip_prefix(b"data:") {
                let data = data.strip_prefix(b" ").unwrap_or(data);
                self.take_usage_from(data);
            }
        }
    }

    fn take_usage_from(&mut self, json: &[u8]) {
        if let Ok(WithUsage {
            usage: Some(u),
            timings,
        }) = serde_json::from_slice::<WithUsage>(json)
        {
            self.usage = Some(Usage {
                prompt_tokens: u.prompt_tokens,
                // A details object without `cached_tokens` means none were cached (vLLM omits
                // zero); no details object means the engine does not report it there, and then
                // llama.cpp's `timings.cache_n` (schema::engine::cached_tokens) is the answer.
                cached_tokens: schema::engine::cached_tokens(
                    u.prompt_tokens_details
                        .map(|d| d.cached_tokens.unwrap_or(0)),
                    timings.and_then(|t| t.cache_n),
                ),
                completion_tokens: u.completion_tokens,
            });
        }
    }
}

/// Position and length of the first event boundary (`\n\n` or `\n\r\n`) in `hay`.
fn find_boundary(hay: &[u8]) -> Option<(usize, usize)> {
    let mut from = 0;
    while let Some(i) = hay[from..].iter().position(|&b| b == b'\n') {
        let at = from + i;
        match (hay.get(at + 1), hay.get(at + 2)) {
            (Some(b'\n'), _) => return Some((at, 2)),
            (Some(b'\r'), Some(b'\n')) => return Some((at, 3)),
            _ => from = at + 1,
        }
    }
    None
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    const STREAM: &str = concat!(
        "data: {\"choices\":[{\"index\":0,\"text\":\"a\"}],\"usage\":null}\n\n",
        "data: {\"choices\":[{\"index\":0,\"text\":\"b\",\"finish_reason\":\"length\"}],\"usage\":null}\n\n",
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":1024,\"total_tokens\":1030,\"completion_tokens\":6,\"prompt_tokens_details\":{\"cached_tokens\":1008}}}\n\n",
        "data: [DONE]\n\n"
    );

    fn scan_split(body: &[u8], cut: &[usize]) -> Option<Usage> {
        let mut s = UsageScanner::new(BodyKind::Sse);
        let mut prev = 0;
        for &c in cut.iter().chain(std::iter::once(&body.len())) {
            s.feed(&body[prev..c]);
            prev = c;
        }
        s.finish()
    }

    #[test]
    fn usage_found_at_every_split_point() {
        let body = STREAM.as_bytes();
        let want = Some(Usage {
            prompt_tokens: Some(1024),
            cached_tokens: Some(1008),
            completion_tokens: Some(6),
        });
        for cut in 0..=body.len() {
            assert_eq!(scan_split(body, &[cut]), want, "cut at {cut}");
        }
        // Byte by byte.
        let cuts: Vec<usize> = (1..body.len()).collect();
        assert_eq!(scan_split(body, &cuts), want);
        let mut s = UsageScanner::new(BodyKind::Sse);
        s.feed(&body[..body.len() - 3]);
        assert!(!s.saw_done());
        s.feed(&body[body.len() - 3..]);
        assert!(s.saw_done());
    }

    #[test]
    fn crlf_boundaries_at_every_split_point() {
        let body = STREAM.replace("\n", "\r\n");
        let body = body.as_bytes();
        let want = Some(Usage {
            prompt_tokens: Some(1024),
            cached_tokens: Some(1008),
            completion_tokens: Some(6),
        });
        for cut in 0..=body.len() {
            assert_eq!(scan_split(body, &[cut]), want, "cut at {cut}");
        }
        let cuts: Vec<usize> = (1..body.len()).collect();
        assert_eq!(scan_split(body, &cuts), want);
    }

    #[test]
    fn absent_details_is_unknown_and_empty_details_is_zero() {
        let mut s = UsageScanner::new(BodyKind::Sse);
        s.feed(b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7}}\n\n");
        assert_eq!(
            s.finish(),
            Some(Usage {
                prompt_tokens: Some(7),
                cached_tokens: None,
                completion_tokens: None,
            })
        );
        let mut s = UsageScanner::new(BodyKind::Sse);
        s.feed(b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"prompt_tokens_details\":{}}}\r\n\r\n");
        assert_eq!(
            s.finish(),
            Some(Usage {
                prompt_tokens: Some(7),
                cached_tokens: Some(0),
                completion_tokens: None,
            })
        );
    }

    #[test]
    fn llama_cpp_usage_and_timings() {
        // llama-server 11434's final chunk: usage with details, and timings beside it.
        let mut s = UsageScanner::new(BodyKind::Sse);
        s.feed(b"data: {\"choices\":[],\"usage\":{\"completion_tokens\":8,\"prompt_tokens\":1453,\"total_tokens\":1461,\"prompt_tokens_details\":{\"cached_tokens\":1199}},\"timings\":{\"cache_n\":1199,\"prompt_n\":254}}\n\n");
        assert_eq!(s.finish().unwrap().cached_tokens, Some(1199));
        // An older build without details: `timings.cache_n` answers.
        let mut s = UsageScanner::new(BodyKind::Sse);
        s.feed(b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":10},\"timings\":{\"cache_n\":6}}\n\n");
        assert_eq!(
            s.finish(),
            Some(Usage {
                prompt_tokens: Some(10),
                cached_tokens: Some(6),
                completion_tokens: None,
            })
        );
    }

    #[test]
    fn json_body_parsed_at_end() {
        let mut s = UsageScanner::new(BodyKind::Json);
        s.feed(b"{\"choices\":[{\"text\":\"x\"}],\"usage\":{\"prompt_tokens\":3,");
        s.feed(b"\"prompt_tokens_details\":{\"cached_tokens\":0}}}");
        assert_eq!(
            s.finish(),
            Some(Usage {
                prompt_tokens: Some(3),
                cached_tokens: Some(0),
                completion_tokens: None,
            })
        );
    }

    #[test]
    fn no_usage_and_mid_event_tracking() {
        let mut s = UsageScanner::new(BodyKind::Sse);
        s.feed(b"data: {\"usage\":null}\n\ndata: {\"par");
        assert!(s.mid_event());
        s.feed(b"tial\":1}\n\n");
        assert!(!s.mid_event());
        assert_eq!(s.finish(), None);
        assert_eq!(
            BodyKind::from_content_type(Some(b"text/event-stream; charset=utf-8")),
            BodyKind::Sse
        );
        assert_eq!(
            BodyKind::from_content_type(Some(b"Application/JSON")),
            BodyKind::Json
        );
        assert_eq!(BodyKind::from_content_type(None), BodyKind::Other);
    }
}
