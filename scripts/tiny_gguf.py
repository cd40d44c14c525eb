#!/usr/bin/env python3
"""Writes kvroute's tiny llama.cpp grid model: a GGUF file llama-server loads like any model.

- Architecture `llama`: 4 layers, 256 wide, 4 heads (head dim 64, no GQA), FFN 768, RoPE, RMSNorm;
  trained context 32768 tokens. Weights are F32, seeded (numpy PCG64, seed 17): the same bytes on
  every machine and every run.
- Vocabulary: SentencePiece-style (`tokenizer.ggml.model = llama`) with 3 control tokens
  (`<unk>`, `<s>`, `</s>`), the ChatML markers `<|im_start|>` and `<|im_end|>` as control tokens,
  and the 256 byte tokens `<0x00>`..`<0xFF>`. No merges and no space prefix, so any text tokenizes
  to one token per UTF-8 byte (byte fallback): about 1 byte per token, where a real 32k-150k BPE
  vocabulary gives about 4.
- A ChatML chat template, so `/v1/chat/completions` renders conversations as SmolLM2 and Qwen do.
- Output restricted to printable ASCII (0x20..0x7E): the embeddings carry one constant dimension
  that the residual layers barely perturb (their weights are 100x smaller), and the output rows of
  every other token weigh that dimension at -30, so their logits are far below the printable
  ones. A stream therefore never holds back an incomplete UTF-8 sequence: one token, one chunk.

The model computes nonsense, quickly: its job is to exercise llama-server's slots, prompt cache
and scheduling with realistic shapes at ~1 ms per 10 prompt tokens on one CPU thread.

Usage: tiny_gguf.py OUT.gguf
"""

import sys

import numpy as np
import gguf

N_EMBD = 256
N_LAYER = 4
N_HEAD = 4
N_FF = 768
CTX = 32768
SEED = 17
CONST_DIM = 0
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def vocab():
    tokens, scores, types = [], [], []
    T = gguf.TokenType
    for text in ["<unk>", "<s>", "</s>"]:
        tokens.append(text)
        scores.append(0.0)
        types.append(T.UNKNOWN if text == "<unk>" else T.CONTROL)
    for text in ["<|im_start|>", "<|im_end|>"]:
        tokens.append(text)
        scores.append(0.0)
        types.append(T.CONTROL)
    first_byte = len(tokens)
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        scores.append(0.0)
        types.append(T.BYTE)
    return tokens, scores, types, first_byte


def main(out):
    rng = np.random.default_rng(SEED)
    tokens, scores, types, first_byte = vocab()
    n_vocab = len(tokens)

    def w(rows, cols, scale):
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    writer = gguf.GGUFWriter(out, arch="llama")
    writer.add_name("kvroute-tiny-byte")
    writer.add_context_length(CTX)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD)
    writer.add_rope_dimension_count(N_EMBD // N_HEAD)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(4)  # <|im_end|>, as ChatML models end a turn
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    embd = w(n_vocab, N_EMBD, 1.0)
    embd[:, CONST_DIM] = 30.0
    writer.add_tensor("token_embd.weight", embd)
    small = 0.01
    for i in range(N_LAYER):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.attn_q.weight", w(N_EMBD, N_EMBD, small))
        writer.add_tensor(f"blk.{i}.attn_k.weight", w(N_EMBD, N_EMBD, small))
        writer.add_tensor(f"blk.{i}.attn_v.weight", w(N_EMBD, N_EMBD, small))
        writer.add_tensor(f"blk.{i}.attn_output.weight", w(N_EMBD, N_EMBD, small))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", w(N_FF, N_EMBD, small))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", w(N_FF, N_EMBD, small))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", w(N_EMBD, N_FF, small))
    writer.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    out_w = w(n_vocab, N_EMBD, 0.1)
    printable = np.zeros(n_vocab, dtype=bool)
    printable[first_byte + 0x20 : first_byte + 0x7F] = True
    out_w[:, CONST_DIM] = np.where(printable, 0.0, -30.0)
    writer.add_tensor("output.weight", out_w)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"tiny_gguf.py: wrote {out} ({n_vocab} tokens, {N_LAYER}x{N_EMBD}, seed {SEED})")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: tiny_gguf.py OUT.gguf")
    main(sys.argv[1])
