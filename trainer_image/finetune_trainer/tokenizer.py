"""Tokenizers: a byte-level one for inline (randomly initialised) models, the model's own
(`AutoTokenizer`) for real ones."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from finetune_operator.api.spec import ModelSpec
from finetune_operator.api.storage import ObjectStoreSpec
from finetune_trainer.hub_snapshot import downloading
from finetune_trainer.startup_progress import phase

BOS, EOS, PAD = "<bos>", "<eos>", "<pad>"

# A minimal chat format for byte-level models: role header, content, eos.
BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """Printable stand-ins for the 256 byte values (the GPT-2 byte-level convention, which the
    `tokenizers` ByteLevel pre-tokenizer and decoder use): printable Latin-1 bytes map to
    themselves, the rest to code points from 256 upwards, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping: dict[int, str] = {}
    extra = 0
    for b in range(256):
        if b in keep:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """Token id = byte value (0..255), then <bos>=256, <eos>=257, <pad>=258."""
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([BOS, EOS, PAD])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD
    )
    tok.chat_template = BYTE_CHAT_TEMPLATE
    return tok


def build_tokenizer(
    spec: ModelSpec, object_store: ObjectStoreSpec | None = None, cache_dir: Path | None = None
) -> PreTrainedTokenizerBase:
    """The model's tokenizer; `object_store`: where an s3:// model's files are (its tokenizer
    files are fetched with its config into `cache_dir`, the pod's data cache: remote_model)."""
    if spec.source == "inline":
        return build_byte_tokenizer()
    if spec.source == "hub":
        where: str | Path | None = spec.weights_location()  # the tokenizer's files alone
    else:
        from finetune_trainer.model import weights_dir

        # The model's own directory (an s3:// model's fetched config and tokenizer files).
        # The tokenizer is read first: a missing model directory was transformers' "Repo id
        # must be in the form 'namespace/repo_name'" (it took the path for a hub id), a crash
        # torchrun restarted maxRestarts times; refused here naming the field, as the model's
        # own read would.
        where = weights_dir(spec, object_store, cache_dir)
    # A hub model's tokenizer files are a download; the start-up barrier judges its progress.
    with downloading(spec.name) if spec.source == "hub" else phase("tokenizer"):
        tok = AutoTokenizer.from_pretrained(where, revision=spec.revision)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok
