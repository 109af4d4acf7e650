"""Checks, with vLLM's own chat-rendering stack, whether a conversation's
first messages rendered without a generation prompt tokenize to a prefix
of the whole conversation's prompt: the stable prefix the picker keys
chat requests by (picker/kvevents/lookup.go).

    python prefixcheck.py MODEL_DIR

MODEL_DIR is the tests' tiny model (its byte-level BPE tokenizer and chat
template). Every other template is rendered the way vLLM renders chat
requests (transformers' apply_chat_template with tokenize=False, then the
tokenizer with add_special_tokens=False), with the tiny tokenizer given
the template's special tokens as atomic added tokens, as the real models'
tokenizers have them. The templates are this project's own renditions of
the structure of the Llama 3.1, Qwen2.5, Qwen3 and Mistral v0.3 chat
templates (what decides prefix stability: where the system prompt goes,
what an assistant turn becomes once a later user turn follows). Mistral's
own tokenizers (mistral_common, vLLM's tokenizer mode "mistral") render
conversations themselves; they are checked with their bundled tokenizer
files.

Prints one JSON object per template: of the message boundaries checked,
how many were stable ("all"), of those the picker uses ("system": the
system prompt alone; "warmed": everything but the last message), and the
first unstable one.
"""

import json
import os
import random
import sys

LLAMA3 = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] | trim %}"
    "{%- set rest = messages[1:] %}{%- else %}{%- set system = '' %}{%- set rest = messages %}{%- endif %}"
    "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
    "{{- system }}<|eot_id|>"
    "{%- for m in rest %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}"
)

QWEN25 = (
    "{%- if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)

# Qwen3: an assistant turn's reasoning (<think>...</think>) is kept only
# after the last user turn.
QWEN3 = (
    "{%- set ns = namespace(last=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' %}"
    "{%- set content = m['content'] %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last and reasoning %}<|im_start|>assistant\n<think>\n{{ reasoning }}\n</think>\n\n{{ content }}<|im_end|>\n"
    "{%- else %}<|im_start|>assistant\n{{ content }}<|im_end|>\n{%- endif %}"
    "{%- else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)

# Mistral v0.3 (Hugging Face template): the system prompt goes into the
# last user turn.
MISTRAL03 = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}{%- set rest = messages[1:] %}"
    "{%- else %}{%- set rest = messages %}{%- endif %}"
    "{{- bos_token }}"
    "{%- for m in rest %}"
    "{%- if m['role'] == 'user' %}"
    "{%- if loop.last and system is defined %}{{- '[INST] ' + system + '\n\n' + m['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + m['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif m['role'] == 'assistant' %}{{- ' ' + m['content'] + eos_token }}{%- endif %}"
    "{%- endfor %}"
)

TEMPLATES = [
    ("tiny (the test model's own)", None, []),
    ("Llama 3.1", LLAMA3, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]),
    ("Qwen2.5", QWEN25, ["<|im_start|>", "<|im_end|>"]),
    ("Qwen3, answers with reasoning", QWEN3, ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]),
    ("Mistral v0.3 (HF template)", MISTRAL03, ["[INST]", "[/INST]"]),
]

SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "ta", "shi", "vo", "de", "pa", "gri", "ol", "en", "ast", "ing", "er"]


def words(rng, n):
    return " ".join("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(n))


def conversations(rng, thinking):
    """Seeded conversations: a system prompt and 1-4 turns, each ending with
    a user message; some contents end with a space or a line break."""
    out = []
    for i in range(40):
        msgs = [{"role": "system", "content": words(rng, rng.randint(20, 60))}]
        for t in range(rng.randint(1, 4)):
            q = words(rng, rng.randint(3, 20))
            if i % 7 == 3:
                q += rng.choice([" ", "\n"])
            msgs.append({"role": "user", "content": q})
            if t < 3:
                a = words(rng, rng.randint(3, 20))
                if thinking:
                    a = "<think>\n" + words(rng, 8) + "\n</think>\n\n" + a
                msgs.append({"role": "assistant", "content": a})
        if msgs[-1]["role"] == "assistant":
            msgs.pop()
        out.append(msgs)
    return out


def check(name, render, convs):
    """Tallies every message boundary, and apart the two the picker uses:
    the system prompt alone and everything but the last message (the
    prefix it warms)."""
    tally = {"all": [0, 0], "system": [0, 0], "warmed": [0, 0]}
    first = None
    for msgs in convs:
        whole = render(msgs, True)
        for j in range(1, len(msgs)):
            kinds = ["all"] + (["system"] if j == 1 else []) + (["warmed"] if j == len(msgs) - 1 else [])
            for k in kinds:
                tally[k][0] += 1
            try:
                pre = render(msgs[:j], False)
                ok = len(pre) < len(whole) and whole[: len(pre)] == pre
                why = "prefix of %d messages (last role %s) of %d" % (j, msgs[j - 1]["role"], len(msgs))
            except Exception as e:  # the renderer refuses the prefix
                ok, why = False, "prefix of %d messages refused: %s" % (j, str(e)[:100])
            if ok:
                for k in kinds:
                    tally[k][1] += 1
            elif first is None:
                first = why
    out = {"template": name, "first_unstable": first}
    for k, (n, ok) in tally.items():
        out[k] = "%d/%d" % (ok, n)
    print(json.dumps(out), flush=True)


def main():
    from transformers import AutoTokenizer

    model_dir = sys.argv[1]
    for name, template, specials in TEMPLATES:
        tok = AutoTokenizer.from_pretrained(model_dir)
        if specials:
            tok.add_special_tokens({"additional_special_tokens": specials})
        kwargs = {}
        if template is not None:
            kwargs["chat_template"] = template
        if name.startswith("Llama"):
            tok.bos_token = "<|begin_of_text|>"

        def render(msgs, gen, tok=tok, kwargs=kwargs):
            text = tok.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False, **kwargs)
            return tok.encode(text, add_special_tokens=False)

        check(name, render, conversations(random.Random(7), "reasoning" in name))

    from mistral_common.protocol.instruct.messages import AssistantMessage, SystemMessage, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
    import mistral_common

    data = os.path.join(os.path.dirname(mistral_common.__file__), "data")
    kinds = {"system": SystemMessage, "user": UserMessage, "assistant": AssistantMessage}
    for name, f in [("Mistral tokenizer v3 (mistral_common)", "mistral_instruct_tokenizer_240323.model.v3"),
                    ("Mistral tokenizer v7 tekken (mistral_common)", "tekken_240911.json")]:
        tok = MistralTokenizer.from_file(os.path.join(data, f))

        def render(msgs, gen, tok=tok):
            req = ChatCompletionRequest(messages=[kinds[m["role"]](content=m["content"]) for m in msgs])
            return tok.encode_chat_completion(req).tokens

        check(name, render, conversations(random.Random(7), False))


if __name__ == "__main__":
    main()
