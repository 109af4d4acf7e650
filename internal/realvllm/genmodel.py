"""Generates the tiny model the real-vLLM tests serve, with no model hub.

    python genmodel.py OUT_DIR

writes, deterministically (fixed seeds, generated corpus):
  OUT_DIR/model    a Llama model with random weights (hidden 128, 2 layers,
                   4 heads of 32, 4096 positions, float32, ~0.85 M parameters)
                   and a byte-level BPE tokenizer trained here, with a chat
                   template;
  OUT_DIR/adapter  a LoRA adapter for it in PEFT's layout (rank 8 on the q
                   and v projections), written without the peft package.
The output text is random tokens: tests control its length with max_tokens
and ignore_eos. OUT_DIR/.complete marks a finished run; a second run with
that marker present does nothing.
"""

import json
import os
import random
import shutil
import sys

SEED = 20261124
VOCAB = 2048
HIDDEN = 128
LAYERS = 2
HEADS = 4
RANK = 8

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def corpus(rng):
    """Pseudo-English lines from a fixed syllable set, so BPE learns merges."""
    syllables = [
        "ka", "lo", "mi", "ne", "ru", "ta", "shi", "vo", "de", "pa", "gri",
        "ol", "en", "ast", "ing", "er", "th", "qu", "ix", "um", "bra", "zo",
    ]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    words += ["the", "a", "of", "and", "system", "user", "assistant", "prompt", "answer"]
    for _ in range(4000):
        yield " ".join(rng.choice(words) for _ in range(rng.randint(8, 40))) + "."


def build_tokenizer(model_dir, rng):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus(rng)), trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 4096
    fast.save_pretrained(model_dir)
    return fast


def build_model(model_dir, fast):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    vocab = (len(fast) + 63) // 64 * 64
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=4096,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(model_dir, safe_serialization=True)


def build_adapter(adapter_dir, model_dir):
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(SEED + 1)
    tensors = {}
    for layer in range(LAYERS):
        for proj in ("q_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[prefix + ".lora_A.weight"] = torch.randn(RANK, HIDDEN, generator=gen) * 0.02
            tensors[prefix + ".lora_B.weight"] = torch.randn(HIDDEN, RANK, generator=gen) * 0.02
    os.makedirs(adapter_dir, exist_ok=True)
    save_file(tensors, os.path.join(adapter_dir, "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": model_dir,
        "r": RANK,
        "lora_alpha": 2 * RANK,
        "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"],
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
    }
    with open(os.path.join(adapter_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: genmodel.py OUT_DIR")
    out = os.path.abspath(sys.argv[1])
    if os.path.exists(os.path.join(out, ".complete")):
        print(out)
        return
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    rng = random.Random(SEED)
    model_dir = os.path.join(tmp, "model")
    fast = build_tokenizer(model_dir, rng)
    build_model(model_dir, fast)
    # The adapter names the model by its final path, not the temporary one.
    build_adapter(os.path.join(tmp, "adapter"), os.path.join(out, "model"))
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    open(os.path.join(out, ".complete"), "w").close()
    print(out)


if __name__ == "__main__":
    main()
