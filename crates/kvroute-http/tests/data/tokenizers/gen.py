"""Writes the tokenizer conformance fixtures: small tokenizers shaped like real models' and the
token ids that Hugging Face's reference `tokenizers` (the Python package) gives for a set of texts.

Each tokenizer is a BPE trained here on the repository's own Markdown, so its merges are real
merges, in the pipeline shape of a model family:
- `llama3.json`: Llama-3's split regex, then byte-level without regex, `ignore_merges`;
- `qwen2.json`: NFC normalization, Qwen2's split regex (single digits), then byte-level;
- `gpt2.json`: byte-level with GPT-2's built-in regex;
- `llama2.json`: SentencePiece-style BPE (prepend and replace with U+2581, byte fallback).

`cases.json` holds, for every tokenizer, each text of TEXTS and its ids (special tokens written in
the text are recognized, none are added). The Rust test `tests/tokenizers.rs` checks that
`Model::encode` gives the same ids.

Run from this folder: `pip install tokenizers` then `python3 gen.py`.
"""
import json
import pathlib

import tokenizers
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

HERE = pathlib.Path(__file__).parent
ROOT = HERE.parents[4]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

TEXTS = [
    "",
    "Hello, world!",
    "System prompt number 3: you are a helpful assistant that answers briefly and well. "
    "Context for group 3 follows, repeated so the prompt spans several blocks of tokens. "
    "The user asks question 1234567: what is the capital of the country with index 1234567?",
    "  leading spaces, trailing spaces   ",
    "tabs\tand\nnewlines\r\n\n\nand   runs of    spaces",
    "don't we'll they've I'm she'd it's YOU'RE",
    "numbers 1 12 123 1234 12345 3.14159 -42 1e10",
    "unicode: héllo wörld, naïve café, Ελληνικά, русский, 日本語のテキスト, 한국어, العربية",
    "emoji 🙂👍🏽 and symbols ∑∫√ ©®™ «quotes» “curly”",
    "combining: e\u0301 vs \u00e9, A\u030a vs \u00c5",
    "<|im_start|>system\nYou are kvroute's test.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    "<|im_start|>assistant\n",
    "special<|endoftext|>glued<|im_end|>to words",
    "code: fn main() { let x = vec![1, 2, 3]; println!(\"{x:?}\"); }",
    "a" * 300,
    "the quick brown fox jumps over the lazy dog " * 8,
]


def corpus():
    texts = []
    for path in sorted(ROOT.glob("*.md")):
        texts.extend(path.read_text(encoding="utf-8").splitlines())
    return texts


def added_tokens(tok):
    tok.add_special_tokens(SPECIALS)


def byte_level_bpe(split, normalizer, ignore_merges):
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=800, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    return tok


def gpt2():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=800, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    return tok


def llama2():
    tok = Tokenizer(models.BPE(byte_fallback=True, fuse_unk=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([
        normalizers.Prepend("\u2581"),
        normalizers.Replace(" ", "\u2581"),
    ])
    tok.decoder = decoders.Sequence([
        decoders.Replace("\u2581", " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
        decoders.Strip(" ", 1, 0),
    ])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=800, special_tokens=["<unk>"] + SPECIALS + byte_tokens,
                                  show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    return tok


def main():
    tokenizers_ = {
        "llama3": byte_level_bpe(LLAMA3_SPLIT, None, True),
        "qwen2": byte_level_bpe(QWEN2_SPLIT, normalizers.NFC(), False),
        "gpt2": gpt2(),
        "llama2": llama2(),
    }
    cases = {"reference": f"tokenizers {tokenizers.__version__} (Python)", "tokenizers": {}}
    for name, tok in tokenizers_.items():
        tok.save(str(HERE / f"{name}.json"))
        cases["tokenizers"][name] = [
            {"text": text, "ids": tok.encode(text, add_special_tokens=False).ids} for text in TEXTS
        ]
    lines = [json.dumps(case, ensure_ascii=False) for tok in cases["tokenizers"].values() for case in tok]
    text = json.dumps(cases, ensure_ascii=False, indent=1)
    for line in lines:
        pretty = json.dumps(json.loads(line), ensure_ascii=False, indent=1)
        text = text.replace(pretty.replace("\n", "\n   "), line, 1)
    (HERE / "cases.json").write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
