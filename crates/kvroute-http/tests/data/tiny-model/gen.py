"""Writes tokenizer.json and tokenizer_config.json of the tiny test model.

A byte-level BPE with no merges: every byte of the text is one token (ids 0-255, GPT-2's
byte-to-unicode alphabet), plus three special tokens. Distinct texts give distinct token ids, so
prefix caching behaves as with a real tokenizer, and the file is a few kilobytes.
Run: python3 gen.py (no third-party package needed).
"""
import json


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


alphabet = bytes_to_unicode()
vocab = {alphabet[b]: b for b in range(256)}
specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
added = []
for i, tok in enumerate(specials):
    vocab[tok] = 256 + i
    added.append({"id": 256 + i, "content": tok, "single_word": False, "lstrip": False,
                  "rstrip": False, "normalized": False, "special": True})
tokenizer = {
    "version": "1.0",
    "truncation": None,
    "padding": None,
    "added_tokens": added,
    "normalizer": None,
    # Split before spaces (a plain string pattern, no regex), then map bytes: words stay short,
    # so the BPE model's word cache serves repeated words. Ids are one per byte either way.
    "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithNext", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
    ]},
    "post_processor": None,
    "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
    "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
              "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
              "ignore_merges": False, "vocab": vocab, "merges": []},
}
template = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
config = {
    "model_max_length": 1048576,
    "bos_token": None,
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
    "tokenizer_class": "PreTrainedTokenizerFast",
    "chat_template": template,
}
with open("tokenizer.json", "w") as f:
    json.dump(tokenizer, f, ensure_ascii=False, indent=1)
    f.write("\n")
with open("tokenizer_config.json", "w") as f:
    json.dump(config, f, ensure_ascii=False, indent=1)
    f.write("\n")
