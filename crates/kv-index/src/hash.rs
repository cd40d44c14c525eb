//! Stable, chained, salted block keys.
//!
//! Key `i` is `xxh3_64_with_seed(block_i, key_{i-1})`, and key 0 is seeded with a hash of the salt
//! mixed with a domain constant (bytes and token ids live in different domains, so a byte prompt
//! can never alias a token prompt). Because every key is seeded by its predecessor, one key names a
//! whole prefix. Only full blocks are keyed: a trailing partial block is ignored, as vLLM ignores it.
//!
//! xxh3 with fixed seeds is specified bit-for-bit, and token ids are encoded little-endian, so keys
//! are identical across processes, platforms and releases of this crate (the golden-value test
//! pins them).

use crate::BlockKey;
use std::borrow::Cow;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Domain constant for byte-block keys ("kvroute-bytes").
const BYTE_DOMAIN: u64 = 0x6b76_726f_7574_6542;
/// Domain constant for token-block keys ("kvroute-tokens").
const TOKEN_DOMAIN: u64 = 0x6b76_726f_7574_6554;

/// Separates a request's `cache_salt` from the salt it extends (0xff never occurs in UTF-8, so
/// no model name can end where a salted one continues).
const CACHE_SALT_SEPARATOR: &[u8] = b"\xffcache_salt\xff";

/// The salt of block 0 for a request with `cache_salt`: `salt` itself when there is none (or it
/// is empty), else `salt ‖ 0xff "cache_salt" 0xff ‖ cache_salt`.
///
/// This mirrors the engines: vLLM adds `("cache_salt", salt)` to the extra keys of block 0 only
/// when the salt is non-empty (`generate_block_hash_extra_keys` in `vllm/v1/core/kv_cache_utils.py`,
/// 0.33.0), and every later hash chains from block 0, so a salted prompt shares no block with
/// the same tokens unsalted; SGLang keys its radix tree by (tokens, cache_salt). Unsalted keys are
/// unchanged (the golden values below hold).
pub fn cache_salted<'a>(salt: &'a [u8], cache_salt: Option<&[u8]>) -> Cow<'a, [u8]> {
    match cache_salt {
        Some(c) if !c.is_empty() => {
            let mut s = Vec::with_capacity(salt.len() + CACHE_SALT_SEPARATOR.len() + c.len());
            s.extend_from_slice(salt);
            s.extend_from_slice(CACHE_SALT_SEPARATOR);
            s.extend_from_slice(c);
            Cow::Owned(s)
        }
        _ => Cow::Borrowed(salt),
    }
}

/// The seed of block 0 for byte keying under `salt`.
pub fn byte_salt_seed(salt: &[u8]) -> u64 {
    xxh3_64_with_seed(salt, BYTE_DOMAIN)
}

/// The seed of block 0 for token keying under `salt`.
pub fn token_salt_seed(salt: &[u8]) -> u64 {
    xxh3_64_with_seed(salt, TOKEN_DOMAIN)
}

/// Keys of the full `block_bytes`-sized blocks of `bytes`, chained from block 0 salted by `salt`.
///
/// `block_bytes == 0` yields no keys.
pub fn byte_block_keys(salt: &[u8], bytes: &[u8], block_bytes: usize) -> Vec<BlockKey> {
    let mut out = Vec::new();
    byte_block_keys_into(salt, bytes, block_bytes, &mut out);
    out
}

/// Like [`byte_block_keys`], but clears and fills `out` (no allocation once `out` has grown).
pub fn byte_block_keys_into(
    salt: &[u8],
    bytes: &[u8],
    block_bytes: usize,
    out: &mut Vec<BlockKey>,
) {
    out.clear();
    if block_bytes == 0 {
        return;
    }
    out.reserve(bytes.len() / block_bytes);
    let mut prev = byte_salt_seed(salt);
    for block in bytes.chunks_exact(block_bytes) {
        prev = xxh3_64_with_seed(block, prev);
        out.push(prev);
    }
}

/// The prompt tokens whose blocks an engine can serve from its prefix cache: all but the last.
///
/// vLLM computes at least the prompt's last token (`max_cache_hit_length = num_tokens − 1` in
/// `KVCacheManager.get_computed_blocks`, `vllm/v1/core/kv_cache_manager.py`, 0.32.0) and rounds
/// the hit down to whole blocks, so a fully cached prompt whose length is a multiple of the
/// block size is reported one block short; the emulator follows the same rule. Keying these
/// tokens makes an exact match predict what the engine will report as cached.
pub fn cacheable_prompt_tokens(tokens: &[u32]) -> &[u32] {
    &tokens[..tokens.len().saturating_sub(1)]
}

/// Keys of the full `block_tokens`-sized blocks of `tokens`, chained from block 0 salted by `salt`.
///
/// Token ids are hashed as little-endian `u32`s. `block_tokens == 0` yields no keys.
pub fn token_block_keys(salt: &[u8], tokens: &[u32], block_tokens: usize) -> Vec<BlockKey> {
    let mut out = Vec::new();
    token_block_keys_into(salt, tokens, block_tokens, &mut out);
    out
}

/// Like [`token_block_keys`], but clears and fills `out`.
pub fn token_block_keys_into(
    salt: &[u8],
    tokens: &[u32],
    block_tokens: usize,
    out: &mut Vec<BlockKey>,
) {
    out.clear();
    chain_token_keys(token_salt_seed(salt), tokens, block_tokens, out);
}

/// Appends to `out` the keys of the full blocks of `tokens`, continuing a token chain whose last
/// key is `parent` (use [`token_salt_seed`] for a chain that starts at block 0).
///
/// This is how an event-fed index re-derives its own keys for a `BlockStored` event that extends
/// an earlier chain.
pub fn chain_token_keys(parent: u64, tokens: &[u32], block_tokens: usize, out: &mut Vec<BlockKey>) {
    if block_tokens == 0 || tokens.len() < block_tokens {
        return;
    }
    out.reserve(tokens.len() / block_tokens);
    let mut buf = vec![0u8; block_tokens * 4];
    let mut prev = parent;
    for block in tokens.chunks_exact(block_tokens) {
        for (dst, t) in buf.chunks_exact_mut(4).zip(block) {
            dst.copy_from_slice(&t.to_le_bytes());
        }
        prev = xxh3_64_with_seed(&buf, prev);
        out.push(prev);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cacheable_prompt_leaves_out_the_last_token() {
        assert_eq!(cacheable_prompt_tokens(&[1, 2, 3]), &[1, 2]);
        assert!(cacheable_prompt_tokens(&[]).is_empty());
        // A 32-token prompt has no full cacheable 32-token block (vLLM reports 0 cached).
        let ids: Vec<u32> = (0..32).collect();
        assert!(token_block_keys(b"m", cacheable_prompt_tokens(&ids), 32).is_empty());
    }

    #[test]
    fn only_full_blocks_are_keyed() {
        assert_eq!(byte_block_keys(b"m", &[7u8; 63], 64).len(), 0);
        assert_eq!(byte_block_keys(b"m", &[7u8; 64], 64).len(), 1);
        assert_eq!(byte_block_keys(b"m", &[7u8; 191], 64).len(), 2);
        assert_eq!(token_block_keys(b"m", &[1u32; 31], 16).len(), 1);
        assert!(byte_block_keys(b"m", &[7u8; 64], 0).is_empty());
        assert!(token_block_keys(b"m", &[7u32; 64], 0).is_empty());
    }

    #[test]
    fn a_key_names_its_whole_prefix() {
        let a: Vec<u8> = (0..256u32).map(|i| (i % 251) as u8).collect();
        let mut b = a.clone();
        b[10] ^= 1; // differs in block 0 only
        let ka = byte_block_keys(b"m", &a, 64);
        let kb = byte_block_keys(b"m", &b, 64);
        assert!(
            ka.iter().zip(&kb).all(|(x, y)| x != y),
            "every later key must change"
        );
        let mut c = a.clone();
        c[200] ^= 1; // differs in block 3 only
        let kc = byte_block_keys(b"m", &c, 64);
        assert_eq!(ka[..3], kc[..3]);
        assert_ne!(ka[3], kc[3]);
    }

    #[test]
    fn salt_and_domain_separate_chains() {
        let bytes = [1u8; 64];
        assert_ne!(
            byte_block_keys(b"a", &bytes, 64),
            byte_block_keys(b"b", &bytes, 64)
        );
        // 16 tokens of 0x01010101 are the same 64 bytes as above, but a different domain.
        let tokens = [0x0101_0101u32; 16];
        assert_ne!(
            byte_block_keys(b"a", &bytes, 64),
            token_block_keys(b"a", &tokens, 16)
        );
    }

    #[test]
    fn a_cache_salt_separates_the_whole_chain_and_an_empty_one_is_none() {
        let tokens: Vec<u32> = (0..48).collect();
        let plain = token_block_keys(b"m", &tokens, 16);
        let salted = token_block_keys(&cache_salted(b"m", Some(b"tenant-a")), &tokens, 16);
        assert!(plain.iter().zip(&salted).all(|(p, s)| p != s));
        assert_ne!(
            salted,
            token_block_keys(&cache_salted(b"m", Some(b"tenant-b")), &tokens, 16)
        );
        assert_eq!(&*cache_salted(b"m", Some(b"")), b"m");
        assert_eq!(&*cache_salted(b"m", None), b"m");
    }

    #[test]
    fn continuing_a_chain_equals_hashing_it_whole() {
        let tokens: Vec<u32> = (0..80).collect();
        let whole = token_block_keys(b"model", &tokens, 16);
        let mut tail = Vec::new();
        chain_token_keys(whole[1], &tokens[32..], 16, &mut tail);
        assert_eq!(&whole[2..], &tail[..]);
    }

    #[test]
    fn keys_are_stable_golden_values() {
        // Pinned values: a change here breaks every other router that shares keys with us.
        let b = byte_block_keys(b"kvroute/emulated-8b", &[b'a'; 128], 64);
        let t = token_block_keys(b"kvroute/emulated-8b", &(0..32).collect::<Vec<u32>>(), 16);
        let golden = [b[0], b[1], t[0], t[1]];
        let expect = GOLDEN;
        assert_eq!(golden, expect, "golden keys changed: {golden:#x?}");
    }

    const GOLDEN: [u64; 4] = [
        0xb922_6731_611d_e958,
        0xdf13_3fc6_7be1_d0be,
        0xb053_9e90_ded7_b2f5,
        0xd363_8a22_7ae0_107d,
    ];
}
