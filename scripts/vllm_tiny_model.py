#!/usr/bin/env python3
"""Writes kvroute's tiny vLLM model: a Hugging Face model directory vLLM loads like any model.

- `LlamaForCausalLM`, random weights (torch.manual_seed(17), float32): 2 layers, hidden 128,
  4 attention heads (head dim 32), 2 KV heads (grouped-query attention), MLP 256, RoPE, RMSNorm,
  2,048 positions, untied embeddings. Saved as `model.safetensors`.
- Tokenizer: byte-level BPE (GPT-2 style; any text tokenizes) trained with `tokenizers` on seeded
  prose made of the workload's words (`crates/workload/src/text.rs`, read at generation time, as
  scripts/tiny_gguf.py reads them), with the special tokens `<|endoftext|>`, `<|im_start|>` and
  `<|im_end|>`. The vocabulary is capped at 4,096 and ends at 3,121 (the merges the workload's few
  hundred words allow): about 3.5 bytes per token on its prose, one to two tokens per word. The
  prose, the trainer and the merges are deterministic: the same tokenizer.json on every run
  (checked by this script: it trains twice and compares).
- A ChatML chat template in tokenizer_config.json, so `/v1/chat/completions` and `/tokenize` with
  `messages` render conversations as SmolLM2 and Qwen do.

The model computes nonsense, quickly: its job is to run vLLM's real scheduler, prefix cache and KV
events on a CPU with realistic prompt shapes.

Usage: vllm_tiny_model.py OUT_DIR WORKLOAD_TEXT_RS
"""

import hashlib
import json
import os
import random
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload_words import workload_words  # noqa: E402

SEED = 17
VOCAB = 4096
HIDDEN = 128
LAYERS = 2
HEADS = 4
KV_HEADS = 2
MLP = 256
MAX_POS = 2048
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def corpus(words, n_sentences=20000):
    """Seeded prose: sentences of 6-18 words, capitalised, with commas and full stops, the chat
    roles among them, digits now and then."""
    rng = random.Random(SEED)
    out = []
    for _ in range(n_sentences):
        n = rng.randint(6, 18)
        ws = [rng.choice(words) for _ in range(n)]
        if rng.random() < 0.1:
            ws.insert(rng.randrange(len(ws)), rng.choice(["user", "assistant", "system"]))
        if rng.random() < 0.1:
            ws.insert(rng.randrange(len(ws)), str(rng.randint(0, 9999)))
        s = " ".join(ws)
        if n > 10 and rng.random() < 0.5:
            k = s.find(" ", len(s) // 2)
            if k > 0:
                s = s[:k] + "," + s[k:]
        out.append(s[0].upper() + s[1:] + ".")
    return out


def train_tokenizer(lines):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    return tok


def main(out, text_rs):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    lines = corpus(workload_words(text_rs, "vllm_tiny_model.py"))
    tok = train_tokenizer(lines)
    again = train_tokenizer(lines)
    if tok.to_str() != again.to_str():
        sys.exit("vllm_tiny_model.py: tokenizer training is not deterministic")
    os.makedirs(out, exist_ok=True)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        unk_token=None,
        pad_token="<|endoftext|>",
        model_max_length=MAX_POS,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    # The chat template in tokenizer_config.json itself (newer transformers write it to a
    # separate chat_template.jinja): one file for any reader.
    tc_path = os.path.join(out, "tokenizer_config.json")
    tc = json.load(open(tc_path))
    tc["chat_template"] = CHAT_TEMPLATE
    tc["add_bos_token"] = False
    tc["add_eos_token"] = False
    json.dump(tc, open(tc_path, "w"), indent=2, sort_keys=True)
    jinja = os.path.join(out, "chat_template.jinja")
    if os.path.exists(jinja):
        os.remove(jinja)

    vocab = tok.get_vocab_size()
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=MLP,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POS,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tok.token_to_id("<|endoftext|>"),
        eos_token_id=tok.token_to_id("<|im_end|>"),
        pad_token_id=tok.token_to_id("<|endoftext|>"),
        torch_dtype="float32",
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())

    text = "The cache of a model is a table of blocks."
    ids = tok.encode(text).ids
    h = hashlib.sha256(open(os.path.join(out, "model.safetensors"), "rb").read()).hexdigest()[:16]
    th = hashlib.sha256(tok.to_str().encode()).hexdigest()[:16]
    desc = (
        f"LlamaForCausalLM layers={LAYERS} hidden={HIDDEN} heads={HEADS} kv_heads={KV_HEADS} "
        f"mlp={MLP} max_pos={MAX_POS} vocab={vocab} params={params} seed={SEED} "
        f"safetensors_sha256={h} tokenizer_sha256={th}"
    )
    open(os.path.join(out, "kvroute-model.txt"), "w").write(desc + "\n")
    print(f"vllm_tiny_model.py: {desc}", file=sys.stderr)
    print(
        f"vllm_tiny_model.py: {len(text)} bytes -> {len(ids)} tokens on a sample sentence "
        f"({len(text) / len(ids):.2f} bytes/token)",
        file=sys.stderr,
    )


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
