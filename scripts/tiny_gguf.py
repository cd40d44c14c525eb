#!/usr/bin/env python3
"""Writes kvroute's tiny llama.cpp grid model: a GGUF file llama-server loads like any model.

- Architecture `llama`: 4 layers, 256 wide, 4 heads (head dim 64, no GQA), FFN 768, RoPE, RMSNorm;
  trained context 32768 tokens. Weights are F32, seeded (numpy PCG64, seed 17): the same bytes on
  every machine and every run.
- Vocabulary: SentencePiece (`tokenizer.ggml.model = llama`): `<unk>`, `<s>`, `</s>`, the ChatML
  markers `<|im_start|>` and `<|im_end|>` (control tokens), the 256 byte tokens `<0x00>`..`<0xFF>`
  (byte fallback: any text tokenizes), every printable ASCII character and `▁` (SentencePiece's
  space), and one piece per word of kvroute's filler text (`crates/workload/src/text.rs`, read at
  generation time, plus the chat roles) in four forms — `word`, `▁word`, `Word`, `▁Word` — with
  every prefix of each, scored by length. llama.cpp's SentencePiece merge takes the highest score
  first and the leftmost on ties, so a word grows from its left end into one token: about four
  to five bytes per token on the workload's prose, as with a real 32k-150k BPE vocabulary, and
  one token per word, so cutting a prompt at a word boundary moves its count by one.
- A ChatML chat template, so `/v1/chat/completions` renders conversations as SmolLM2 and Qwen do.
- Output restricted to the word and character pieces (never a byte token or a control token):
  the embeddings carry one constant dimension that the residual layers barely perturb (their
  weights are 100x smaller), and the output rows of the excluded tokens weigh that dimension at
  -30, so their logits are far below the others. A stream therefore never holds back an incomplete
  UTF-8 sequence: one token, one chunk.

The model computes nonsense, quickly: its job is to exercise llama-server's slots, prompt cache
and scheduling with realistic shapes on one CPU thread.

Usage: tiny_gguf.py OUT.gguf WORKLOAD_TEXT_RS
"""

import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload_words import workload_words  # noqa: E402

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


SPACE = "\u2581"  # SentencePiece's space


def vocab(words):
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
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        scores.append(0.0)
        types.append(T.BYTE)
    pieces = [SPACE] + [chr(c) for c in range(0x20, 0x7F) if c != 0x20]
    for w in list(words) + ["user", "assistant", "system"]:
        for form in (w, SPACE + w, w.capitalize(), SPACE + w.capitalize()):
            for k in range(2, len(form) + 1):
                pieces.append(form[:k])
    seen = set(tokens)
    for p in pieces:
        if p not in seen:
            seen.add(p)
            tokens.append(p)
            scores.append(float(len(p)))
            types.append(T.NORMAL)
    return tokens, scores, types


def main(out, text_rs):
    rng = np.random.default_rng(SEED)
    tokens, scores, types = vocab(workload_words(text_rs, "tiny_gguf.py"))
    n_vocab = len(tokens)

    def w(rows, cols, scale):
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    writer = gguf.GGUFWriter(out, arch="llama")
    writer.add_name("kvroute-tiny-words")
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
    allowed = np.array([t == gguf.TokenType.NORMAL for t in types])
    out_w[:, CONST_DIM] = np.where(allowed, 0.0, -30.0)
    writer.add_tensor("output.weight", out_w)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"tiny_gguf.py: wrote {out} ({n_vocab} tokens, {N_LAYER}x{N_EMBD}, seed {SEED})")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: tiny_gguf.py OUT.gguf WORKLOAD_TEXT_RS")
    main(sys.argv[1], sys.argv[2])
