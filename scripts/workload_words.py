"""The workload's words, read from `crates/workload/src/text.rs`: the vocabulary both tiny models
(`tiny_gguf.py` for llama.cpp, `vllm_tiny_model.py` for vLLM) are made from, so their tokens fit
the workload's text."""

import re
import sys


def workload_words(text_rs, who):
    """The quoted words of FUNCTION_WORDS and CONTENT_WORDS in `text_rs`; `who` names the caller
    in an error."""
    src = open(text_rs, encoding="utf-8").read()
    words = []
    for name in ("FUNCTION_WORDS", "CONTENT_WORDS"):
        m = re.search(r"const " + name + r": &\[&str\] = &\[(.*?)\];", src, re.S)
        if not m:
            sys.exit(f"{who}: {name} not found in {text_rs}")
        words += re.findall(r'"([^"]+)"', m.group(1))
    if len(words) < 50:
        sys.exit(f"{who}: only {len(words)} words in {text_rs}")
    return words
