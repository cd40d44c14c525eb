//! Deterministic stand-in tokenizer, chat template and generated vocabulary.
//!
//! Text is cut into pieces (an optional leading space plus a run of letters/digits, a run of
//! other whitespace, or one punctuation character), each piece into chunks of at most
//! [`MAX_PIECE_BYTES`] bytes, and each chunk hashed to an id below [`NUM_TEXT_TOKENS`]. English
//! prose comes out at about 4 bytes per token, close to Llama 3's BPE. The mapping is pure and
//! stable across processes, so `/tokenize`, the render endpoints, the cache and the KV events all
//! see the same ids.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Ids below this are ordinary text tokens; special tokens sit above it (as in Llama 3).
pub const NUM_TEXT_TOKENS: u32 = 128_000;
/// Vocabulary size including special tokens.
pub const VOCAB_SIZE: u32 = 128_256;
/// `<|begin_of_text|>`, prepended when `add_special_tokens` is true.
pub const BOS_TOKEN_ID: u32 = 128_000;
/// `<|eot_id|>`, the end-of-turn token that stops generation unless `ignore_eos`.
pub const EOS_TOKEN_ID: u32 = 128_009;
/// Longest chunk of a piece that becomes one token, bytes.
pub const MAX_PIECE_BYTES: usize = 6;

const TOKEN_SEED: u64 = 0x6b76_726f_7574_6531;

const SPECIALS: [(&str, u32); 5] = [
    ("<|begin_of_text|>", 128_000),
    ("<|end_of_text|>", 128_001),
    ("<|start_header_id|>", 128_006),
    ("<|end_header_id|>", 128_007),
    ("<|eot_id|>", 128_009),
];

/// Words the emulated model generates; each is exactly one token.
const GENERATED_WORDS: [&str; 64] = [
    " the", " of", " and", " to", " in", " is", " that", " it", " was", " for", " on", " are",
    " as", " with", " his", " they", " at", " be", " this", " have", " from", " or", " one",
    " had", " by", " word", " but", " not", " what", " all", " were", " we", " when", " your",
    " can", " said", " there", " use", " an", " each", " which", " she", " do", " how", " their",
    " if", " will", " up", " other", " about", " out", " many", " then", " them", " these", " so",
    " some", " her", " would", " make", " like", " him", " into", " time",
];

/// Id of one text chunk (no special-token handling).
pub fn piece_id(piece: &str) -> u32 {
    (xxh3_64_with_seed(piece.as_bytes(), TOKEN_SEED) % u64::from(NUM_TEXT_TOKENS)) as u32
}

#[derive(PartialEq, Clone, Copy)]
enum Class {
    Word,
    Space,
    Other,
}

fn class(c: char) -> Class {
    if c.is_alphanumeric() {
        Class::Word
    } else if c.is_whitespace() {
        Class::Space
    } else {
        Class::Other
    }
}

/// Calls `emit` with every text chunk of `text` (which holds no special tokens), in order.
fn for_each_chunk(text: &str, mut emit: impl FnMut(&str)) {
    let word_follows = |at: usize| {
        text[at..]
            .chars()
            .next()
            .is_some_and(|c| class(c) == Class::Word)
    };
    let mut start = 0;
    while start < text.len() {
        let first = text[start..].chars().next().expect("non-empty remainder");
        let mut end = start + first.len_utf8();
        // A single space glues onto the word that follows it, as BPE tokenizers do.
        let run_class = if first == ' ' && word_follows(end) {
            Class::Word
        } else {
            class(first)
        };
        if run_class != Class::Other {
            for c in text[end..].chars() {
                if class(c) != run_class {
                    break;
                }
                // Leave the last space of a whitespace run to the word after it.
                if run_class == Class::Space && c == ' ' && word_follows(end + 1) {
                    break;
                }
                end += c.len_utf8();
            }
        }
        // Cut the piece into chunks of at most MAX_PIECE_BYTES on char boundaries.
        let mut s = start;
        while s < end {
            let mut e = (s + MAX_PIECE_BYTES).min(end);
            while e > s && !text.is_char_boundary(e) {
                e -= 1;
            }
            if e == s {
                e = s + text[s..].chars().next().expect("char").len_utf8();
            }
            emit(&text[s..e]);
            s = e;
        }
        start = end;
    }
}

/// Tokenizes `text`, recognising Llama 3 special-token strings, appending ids to `out`.
/// With `add_special_tokens` a `<|begin_of_text|>` is prepended.
pub fn encode_into(text: &str, add_special_tokens: bool, out: &mut Vec<u32>) {
    if add_special_tokens {
        out.push(BOS_TOKEN_ID);
    }
    let mut rest = text;
    while !rest.is_empty() {
        match rest.find("<|") {
            None => {
                for_each_chunk(rest, |p| out.push(piece_id(p)));
                break;
            }
            Some(pos) => {
                for_each_chunk(&rest[..pos], |p| out.push(piece_id(p)));
                let tail = &rest[pos..];
                if let Some((s, id)) = SPECIALS.iter().find(|(s, _)| tail.starts_with(s)) {
                    out.push(*id);
                    rest = &tail[s.len()..];
                } else {
                    // Not a special token: "<" is an ordinary punctuation piece.
                    out.push(piece_id("<"));
                    rest = &tail[1..];
                }
            }
        }
    }
}

/// Tokenizes `text` into a fresh vector (see [`encode_into`]).
pub fn encode(text: &str, add_special_tokens: bool) -> Vec<u32> {
    let mut out = Vec::with_capacity(text.len() / 3 + 2);
    encode_into(text, add_special_tokens, &mut out);
    out
}

/// The text pieces `encode` would produce (specials rendered as their strings); for `token_strs`.
pub fn pieces(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        match rest.find("<|") {
            None => {
                for_each_chunk(rest, |p| out.push(p.to_owned()));
                break;
            }
            Some(pos) => {
                for_each_chunk(&rest[..pos], |p| out.push(p.to_owned()));
                let tail = &rest[pos..];
                if let Some((s, _)) = SPECIALS.iter().find(|(s, _)| tail.starts_with(s)) {
                    out.push((*s).to_owned());
                    rest = &tail[s.len()..];
                } else {
                    out.push("<".to_owned());
                    rest = &tail[1..];
                }
            }
        }
    }
    out
}

/// One chat message (role and text content).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// Text content (list contents are flattened to their text parts by the server).
    pub content: String,
}

/// Renders messages through the fixed Llama 3 chat template, with the assistant generation prompt.
pub fn render_chat(messages: &[ChatMessage]) -> String {
    let mut s = String::with_capacity(
        32 + messages
            .iter()
            .map(|m| m.content.len() + m.role.len() + 48)
            .sum::<usize>(),
    );
    s.push_str("<|begin_of_text|>");
    for m in messages {
        s.push_str("<|start_header_id|>");
        s.push_str(&m.role);
        s.push_str("<|end_header_id|>\n\n");
        s.push_str(&m.content);
        s.push_str("<|eot_id|>");
    }
    s.push_str("<|start_header_id|>assistant<|end_header_id|>\n\n");
    s
}

/// Number of words in the generated vocabulary.
pub const NUM_GENERATED_WORDS: usize = GENERATED_WORDS.len();

/// Token id of generated word `i` (taken modulo the vocabulary).
pub fn generated_token(i: usize) -> u32 {
    generated_ids()[i % NUM_GENERATED_WORDS]
}

fn generated_ids() -> &'static [u32; NUM_GENERATED_WORDS] {
    static IDS: std::sync::OnceLock<[u32; NUM_GENERATED_WORDS]> = std::sync::OnceLock::new();
    IDS.get_or_init(|| {
        let mut ids = [0u32; NUM_GENERATED_WORDS];
        for (slot, w) in ids.iter_mut().zip(GENERATED_WORDS) {
            *slot = piece_id(w);
        }
        ids
    })
}

/// Text of a token the emulated model generated (`""` for EOS or an id it never generates).
pub fn decode_token(id: u32) -> &'static str {
    generated_ids()
        .iter()
        .position(|&g| g == id)
        .map(|i| GENERATED_WORDS[i])
        .unwrap_or("")
}

#[cfg(test)]
mod tests {
    use super::*;

    const PROSE: &str = "The quick brown fox jumps over the lazy dog. In the beginning, \
        engineers measured everything twice: latency, throughput and cost. When a fleet serves \
        multi-turn chat, the prefix cache decides how much work each request repeats, and the \
        router decides which cache a conversation lands on. Nothing here is surprising, yet the \
        numbers are rarely published with their spread.";

    #[test]
    fn about_four_bytes_per_token_on_prose() {
        let ids = encode(PROSE, false);
        let ratio = PROSE.len() as f64 / ids.len() as f64;
        assert!((3.5..=4.8).contains(&ratio), "bytes/token {ratio}");
    }

    #[test]
    fn deterministic_and_prefix_stable() {
        let a = encode(PROSE, true);
        assert_eq!(a, encode(PROSE, true));
        assert_eq!(a[0], BOS_TOKEN_ID);
        // Appending text only changes the tail tokens of the shared prefix.
        let b = encode(&format!("{PROSE} And more words follow."), true);
        assert_eq!(&b[..a.len() - 1], &a[..a.len() - 1]);
        assert!(a.iter().all(|&t| t < VOCAB_SIZE));
    }

    #[test]
    fn pieces_match_ids_and_rebuild_text() {
        let text = "héllo  wörld!\n\n<|eot_id|> tail <|x";
        let p = pieces(text);
        assert_eq!(p.concat(), text);
        let ids = encode(text, false);
        assert_eq!(p.len(), ids.len());
        assert!(ids.contains(&EOS_TOKEN_ID));
        assert!(
            p.iter().all(|s| s.len() <= MAX_PIECE_BYTES
                || s.chars().count() == 1
                || s.starts_with("<|"))
        );
    }

    #[test]
    fn chat_template_is_llama3() {
        let msgs = vec![
            ChatMessage {
                role: "system".into(),
                content: "Be brief.".into(),
            },
            ChatMessage {
                role: "user".into(),
                content: "Hi".into(),
            },
        ];
        let s = render_chat(&msgs);
        assert_eq!(
            s,
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>\
             <|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\n"
        );
        let ids = encode(&s, false);
        assert_eq!(ids[0], BOS_TOKEN_ID);
        assert_eq!(ids[1], 128_006);
    }

    #[test]
    fn generated_words_are_single_distinct_tokens() {
        let mut seen = std::collections::HashSet::new();
        for (i, w) in GENERATED_WORDS.iter().enumerate() {
            assert_eq!(encode(w, false), vec![generated_token(i)], "{w:?}");
            assert!(seen.insert(generated_token(i)), "collision on {w:?}");
            assert_eq!(decode_token(generated_token(i)), *w);
        }
        assert_eq!(decode_token(EOS_TOKEN_ID), "");
    }
}
