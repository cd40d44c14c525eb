//! Block texts: each hash id becomes a deterministic block of English-like text, and a request's
//! prompt is its blocks in order, the last one cut to the prompt's length.
//!
//! Block `id` is `workload::text::english_like` seeded by `(seed, id)` and exactly
//! `block_tokens × bytes_per_token` bytes long, so it depends on nothing but the id: two requests
//! that share a leading run of ids share exactly those blocks' bytes, whatever else they hold. A
//! cut block is a prefix of the whole block. The text is the workload's, so bytes per token are
//! the same as every other kvroute workload's (about 3.94 by the engine emulator's tokenizer at
//! 4 bytes a token nominal; see `crates/workload/README.md`).

use xxhash_rust::xxh3::xxh3_64_with_seed;

use workload::text::english_like;

/// Tag mixed into the seed so block texts never share a stream with a workload's texts.
const BLOCK_STREAM: u64 = 0x7472_6163_652d_626c;

/// The full text of block `id`: `block_bytes` bytes, deterministic in `(seed, id)`.
pub fn block_text(seed: u64, id: u64, block_bytes: usize) -> String {
    let block_seed = xxh3_64_with_seed(&id.to_le_bytes(), seed ^ BLOCK_STREAM);
    english_like(block_seed, "", block_bytes)
}

/// Appends a prompt of `prompt_bytes` bytes made of the blocks `ids` (each `block_bytes` long,
/// the last cut) to `out`. `prompt_bytes` must not exceed `ids.len() × block_bytes`.
pub fn prompt_into(
    seed: u64,
    ids: &[u64],
    block_bytes: usize,
    prompt_bytes: usize,
    out: &mut String,
) {
    out.reserve(prompt_bytes);
    let mut left = prompt_bytes;
    for &id in ids {
        if left == 0 {
            break;
        }
        let block = block_text(seed, id, block_bytes);
        let take = left.min(block.len());
        // English-like text is ASCII: every byte offset is a char boundary.
        out.push_str(&block[..take]);
        left -= take;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_is_deterministic_exact_and_its_own() {
        let a = block_text(7, 42, 2048);
        assert_eq!(a.len(), 2048);
        assert_eq!(a, block_text(7, 42, 2048));
        assert!(a.is_ascii());
        assert_ne!(a, block_text(7, 43, 2048));
        assert_ne!(a, block_text(8, 42, 2048));
    }

    #[test]
    fn a_cut_block_is_a_prefix_of_the_whole_block() {
        let mut p = String::new();
        prompt_into(7, &[1, 2, 3], 256, 256 * 2 + 100, &mut p);
        assert_eq!(p.len(), 612);
        assert_eq!(&p[..256], block_text(7, 1, 256));
        assert_eq!(&p[256..512], block_text(7, 2, 256));
        assert_eq!(&p[512..], &block_text(7, 3, 256)[..100]);
    }
}
