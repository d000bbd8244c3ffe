"""A small byte-level BPE tokenizer trained in the test, saved HF style with a chat template."""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]  # ids 0..4
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "Continuous batching lets new requests join while others decode.",
    "héllo wörld, ça va? naïve café résumé",
    "你好，世界。分页缓存。",
    "emoji: 🙂🚀 and symbols: ∑ ∫ √ ≤ ≥",
    "def forward(self, input_ids, positions): return hidden",
]


def make_tokenizer(model_dir: str | Path, *, vocab_size: int = 400) -> Path:
    """Train a byte-level BPE tokenizer and save tokenizer.json + tokenizer_config.json.

    Special tokens: <unk>=0, <s>=1 (bos, prepended by the post-processor), </s>=2 (eos),
    <|im_start|>=3, <|im_end|>=4; a ChatML chat template. Every id is below `vocab_size`
    (keep it <= the model's vocab so encoded prompts are valid model input).

    Returns:
        `model_dir` as a Path (created if needed).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "chat_template": CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1024,
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return model_dir
