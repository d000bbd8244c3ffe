"""Byte-level BPE tokenizers with the special tokens and tool-calling chat templates of two
model families: Llama 3.x (`<|eot_id|>`, JSON tool calls) and Qwen2.5 (ChatML, hermes
`<tool_call>` tags). Trained in the test like `make_tokenizer`'s."""

from __future__ import annotations

import json
from pathlib import Path

from .tokenizer import _CORPUS

# Id 2 is the end-of-turn token in both, matching the tiny models' `eos_token_id`.
_SPECIALS = {
    "llama3": ["<|reserved_special_token_0|>", "<|begin_of_text|>", "<|eot_id|>",
               "<|start_header_id|>", "<|end_header_id|>", "<|end_of_text|>"],
    "qwen2": ["<|reserved_0|>", "<|endoftext|>", "<|im_end|>", "<|im_start|>"],
}  # fmt: skip
_BOS = {"llama3": "<|begin_of_text|>", "qwen2": None}
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|start_header_id|>system<|end_header_id|>\n\n"
    "Environment: ipython\nRespond with a JSON for a function call with its proper arguments "
    'in the format {"name": function name, "parameters": dictionary of argument name and its '
    "value}.\n\n{% for t in tools %}{{ t | tojson(indent=4) }}\n\n{% endfor %}<|eot_id|>"
    "{% endif %}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}"
    '{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments }}}'
    "{% endfor %}{% else %}{{ m['content'] or '' }}{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
QWEN2_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n\nFor each function call, "
    "return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n{% endif %}{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n"
    "</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_TEMPLATES = {"llama3": LLAMA3_TEMPLATE, "qwen2": QWEN2_TEMPLATE}


def make_chat_tokenizer(model_dir: str | Path, style: str, *, vocab_size: int = 400) -> Path:
    """Train a byte-level BPE tokenizer in `style` ("llama3" or "qwen2") and save it with
    tokenizer_config.json (its special tokens, eos = id 2, its chat template).

    Returns:
        `model_dir` as a Path.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = _SPECIALS[style]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [*_CORPUS, '{"name": "get_weather", "arguments": {"city": "Paris"}}', "<tool_call>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus * 4, trainer=trainer)
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    config = {
        "bos_token": _BOS[style],
        "eos_token": specials[2],
        "chat_template": _TEMPLATES[style],
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return model_dir
