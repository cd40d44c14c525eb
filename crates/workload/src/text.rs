//! Deterministic English-like filler text.
//!
//! The router keys prompts by bytes and the engines key them by tokens, so the text must relate
//! bytes to tokens the way real prose does: about four bytes per token. Short function words
//! dominate real English, so they dominate here too; punctuation appears at sentence and clause
//! ends so that a word-and-punctuation tokenizer sees roughly one token per four bytes.

use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64;

/// Frequent short words (articles, pronouns, prepositions): drawn for most positions.
const FUNCTION_WORDS: &[&str] = &[
    "the", "a", "of", "to", "and", "in", "is", "it", "that", "for", "on", "was", "as", "with",
    "be", "at", "by", "this", "we", "you", "or", "an", "are", "not", "but", "from", "they", "his",
    "her", "can", "will", "if", "all", "so", "one", "has", "our", "its", "how", "who", "may", "no",
    "up", "out", "do", "he", "she", "me", "my", "us",
];

/// Content words: nouns, verbs and adjectives of everyday chat, mostly short (as in real
/// prose, where long words are rarer), with some longer ones that tokenizers split.
const CONTENT_WORDS: &[&str] = &[
    "data", "model", "cache", "time", "value", "user", "order", "table", "query", "node", "answer",
    "result", "plan", "route", "token", "block", "queue", "score", "file", "page", "run", "make",
    "find", "keep", "move", "send", "read", "write", "test", "build", "check", "load", "store",
    "share", "count", "need", "help", "show", "give", "take", "work", "use", "small", "large",
    "fast", "slow", "new", "old", "good", "clear", "exact", "early", "late", "stable", "random",
    "recent", "common", "total", "final", "main", "next", "last", "same", "memory", "engine",
    "request", "reply", "window", "budget", "limit", "policy", "measure", "method", "number",
    "example", "question", "problem", "detail", "summary", "context", "river", "city", "market",
    "music", "paper", "letter", "friend", "family", "school", "water", "light", "sound", "world",
    "house", "night", "field", "point", "group", "place", "state",
];

/// Share of positions filled from [`FUNCTION_WORDS`], in percent.
const FUNCTION_WORD_PERCENT: u32 = 45;

/// Writes exactly `len_bytes` bytes of English-like ASCII text, deterministic in `seed`.
///
/// `lead`, when given, opens the text (it counts toward `len_bytes`); it is how each conversation
/// gets a distinct first block even if two seeds happened to draw the same first words.
pub fn english_like(seed: u64, lead: &str, len_bytes: usize) -> String {
    let mut rng = Pcg64::seed_from_u64(seed);
    let mut out = String::with_capacity(len_bytes + 16);
    out.push_str(lead);
    let mut words_in_sentence = 0u32;
    let mut sentence_len = rng.random_range(8..20u32);
    while out.len() < len_bytes {
        let pick_function = rng.random_range(0..100u32) < FUNCTION_WORD_PERCENT;
        let list = if pick_function {
            FUNCTION_WORDS
        } else {
            CONTENT_WORDS
        };
        let word = list[rng.random_range(0..list.len())];
        if !out.is_empty() && !out.ends_with(' ') {
            out.push(' ');
        }
        if words_in_sentence == 0 {
            // Sentences start capitalized, as prose does; tokenizers see a different token.
            let mut chars = word.chars();
            if let Some(first) = chars.next() {
                out.push(first.to_ascii_uppercase());
                out.push_str(chars.as_str());
            }
        } else {
            out.push_str(word);
        }
        words_in_sentence += 1;
        if words_in_sentence >= sentence_len {
            out.push('.');
            words_in_sentence = 0;
            sentence_len = rng.random_range(8..20u32);
        } else if words_in_sentence.is_multiple_of(9) {
            out.push(',');
        }
    }
    out.truncate(len_bytes);
    // A trailing space would merge differently with whatever the chat template appends.
    if out.ends_with(' ') {
        out.pop();
        out.push('.');
    }
    out
}

/// A simple word tokenizer: runs of alphanumerics are one token, every other non-space
/// character is its own token. Used to check the bytes-per-token ratio of [`english_like`].
pub fn word_token_count(text: &str) -> usize {
    let mut count = 0;
    let mut in_word = false;
    for c in text.chars() {
        if c.is_ascii_alphanumeric() {
            if !in_word {
                count += 1;
                in_word = true;
            }
        } else {
            in_word = false;
            if !c.is_whitespace() {
                count += 1;
            }
        }
    }
    count
}

/// A BPE-like piece tokenizer: a word with its leading space is one piece, every other
/// character is its own piece, and pieces longer than `max_piece_bytes` split into chunks of at
/// most that many bytes (Llama-3-class vocabularies rarely hold longer English pieces). The
/// engine emulator tokenizes this way with 6-byte pieces; used to check the text's ratio.
pub fn piece_token_count(text: &str, max_piece_bytes: usize) -> usize {
    let bytes = text.as_bytes();
    let max = max_piece_bytes.max(1);
    let mut count = 0;
    let mut i = 0;
    while i < bytes.len() {
        let start = i;
        if bytes[i] == b' ' && bytes.get(i + 1).is_some_and(u8::is_ascii_alphanumeric) {
            i += 1;
        }
        if bytes[i].is_ascii_alphanumeric() {
            while i < bytes.len() && bytes[i].is_ascii_alphanumeric() {
                i += 1;
            }
        } else {
            i += 1;
        }
        count += (i - start).div_ceil(max);
    }
    count
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_length_and_deterministic() {
        for len in [0usize, 1, 5, 63, 64, 4400] {
            let a = english_like(7, "", len);
            assert_eq!(a.len(), len);
            assert_eq!(a, english_like(7, "", len));
            assert!(!a.ends_with(' '));
        }
        assert_ne!(english_like(7, "", 200), english_like(8, "", 200));
    }

    #[test]
    fn lead_opens_the_text() {
        let t = english_like(1, "Conversation 12. ", 100);
        assert!(t.starts_with("Conversation 12. "));
        assert_eq!(t.len(), 100);
    }

    #[test]
    fn about_four_bytes_per_word_token() {
        let text = english_like(42, "", 400_000);
        let ratio = text.len() as f64 / word_token_count(&text) as f64;
        assert!((3.5..=4.5).contains(&ratio), "bytes per token {ratio}");
    }

    #[test]
    fn about_four_bytes_per_piece_token() {
        let text = english_like(42, "", 400_000);
        let ratio = text.len() as f64 / piece_token_count(&text, 6) as f64;
        assert!(
            (3.8..=4.2).contains(&ratio),
            "bytes per piece token {ratio}"
        );
    }

    #[test]
    fn piece_tokenizer_attaches_spaces_and_splits_long_words() {
        // "The", " cat", ",", " sat", "." / " international" = 14 bytes → 3 pieces of ≤ 6.
        assert_eq!(piece_token_count("The cat, sat.", 6), 5);
        assert_eq!(piece_token_count(" international", 6), 3);
    }

    #[test]
    fn tokenizer_counts_words_and_punctuation() {
        assert_eq!(word_token_count("The cat, sat."), 5);
        assert_eq!(word_token_count(""), 0);
    }
}
