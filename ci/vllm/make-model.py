#!/usr/bin/env python3
"""Builds the tiny model the real-vLLM suite serves: a LlamaForCausalLM config (random weights
come from `--load-format dummy`) and a byte-level BPE tokenizer trained here on local text.

    $VENV/bin/python ci/vllm/make-model.py [DIR]   # prints DIR; default $PD_CACHE_DIR/tiny-llama

Cached: DIR/.pd-suite-model holds a stamp of this recipe and is written last; a matching stamp
means the directory is complete and nothing is rebuilt.
"""
import glob
import json
import os
import shutil
import sys
import tempfile

VOCAB = 2048
RECIPE = f"tiny-llama v1 vocab={VOCAB} hidden=128 layers=2 heads=4 kv=2 head_dim=32"
SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>' }}{{ m['content'] if m['content'] is string else '' }}{{ '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def corpus():
    files = sorted(glob.glob("/usr/share/common-licenses/*"))
    files = [f for f in files if os.path.isfile(f)]
    if not files:
        # Fall back to any local text so the recipe never needs the network.
        files = sorted(glob.glob("/usr/share/doc/*/copyright"))[:200]
    if not files:
        raise SystemExit("no local text to train the tokenizer on")
    return files


def build(out):
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
    tok.train(corpus(), trainer)
    tok.save(os.path.join(out, "tokenizer.json"))
    vocab = tok.get_vocab_size()
    bos, eos, pad = (tok.token_to_id(t) for t in ("<|bos|>", "<|eos|>", "<|pad|>"))

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "intermediate_size": 256,
        "vocab_size": vocab,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 1024,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    special_map = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}
    generation = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}
    for name, obj in [
        ("config.json", config),
        ("tokenizer_config.json", tokenizer_config),
        ("special_tokens_map.json", special_map),
        ("generation_config.json", generation),
    ]:
        with open(os.path.join(out, name), "w") as f:
            json.dump(obj, f, indent=2)
    return vocab


def main():
    cache = os.environ.get("PD_CACHE_DIR", os.path.expanduser("~/.cache/pd-suite"))
    out = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(cache, "tiny-llama"))
    stamp = os.path.join(out, ".pd-suite-model")
    if os.path.exists(stamp) and open(stamp).read() == RECIPE:
        print(f"model present (reused): {out}", file=sys.stderr)
        print(out)
        return
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-llama-", dir=parent)
    try:
        vocab = build(tmp)
        with open(os.path.join(tmp, ".pd-suite-model"), "w") as f:
            f.write(RECIPE)
        shutil.rmtree(out, ignore_errors=True)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"model built (vocab {vocab}): {out}", file=sys.stderr)
    print(out)


if __name__ == "__main__":
    main()
