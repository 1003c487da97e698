"""A moefied Hugging Face causal LM trained by ``moetrain train`` (docs/moefy.md).

Importing this module registers the model ``hf_moefy`` (``config.yaml`` beside this file names it
under ``imports:``). The builder makes the model one of three ways, from ``model.hf_model``:

- ``""`` (the default): a tiny GPT-2 (2 layers, width 64, 256 tokens) built from its config with
  random weights, then moefied (no download: the example runs anywhere);
- a dense Hugging Face folder (a ``config.json``, with or without weights: without them the model
  is built from the config with random weights): loaded, then moefied with ``match``,
  ``num_experts`` and ``top_k`` (upcycled: each expert a copy of its FFN);
- a moefied Hugging Face folder (its ``config.json`` holds the ``moetrain_moefy`` entry, e.g. one
  written by ``moetrain export-hf``): loaded as saved by ``moetrain.moefy.from_pretrained``
  (``match``, ``num_experts`` and ``top_k`` are then ignored): training goes on from it.

Rank 0 writes the moefied model's config to ``out_dir/hf_config/config.json`` (the architecture
and the ``moetrain_moefy`` entry): ``moetrain export-hf`` reads it to turn the run's checkpoints
into Hugging Face folders.

The data (``data.source: embedded``): counting sequences ``s, s + d, s + 2d, ... (mod vocab)``
with a random start ``s`` and step ``d`` in ``[1, 4]`` per sequence, ``data.seq_len`` tokens:
learnable next-token prediction with no tokenizer and no download.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import moetrain
from moetrain.moefy import RECORD_KEY
from moetrain.registry import register_model
from moetrain.validation import require_int

log = logging.getLogger("hf_moefy_model")

HF_CONFIG_DIR = "hf_config"  # under out_dir: the moefied model's config.json, for moetrain export-hf


@dataclass(frozen=True)
class HFMoefyConfig:
    """``hf_model``: "" (a tiny GPT-2), a dense or a moefied Hugging Face folder (see the module
    docstring); ``model_class``: the transformers class to build (``AutoModelForCausalLM`` or a
    concrete one); ``match`` / ``num_experts`` / ``top_k``: the ``moefy`` call for a dense model."""

    hf_model: str = ""
    model_class: str = "AutoModelForCausalLM"
    match: str = "transformer.h.*.mlp"
    num_experts: int = 4
    top_k: int = 2

    def __post_init__(self) -> None:
        require_int("num_experts", self.num_experts, 1)
        require_int("top_k", self.top_k, 1)
        if not isinstance(self.hf_model, str) or not isinstance(self.match, str) or not self.match:
            raise ValueError("hf_model must be a folder path or '' and match a module name pattern")


def _model_class(name: str):
    import transformers

    model_class = getattr(transformers, name, None)
    if not isinstance(model_class, type) or not name.endswith(("ForCausalLM", "LMHeadModel")):
        raise ValueError(f"model.model_class must name a transformers causal-LM class, got {name!r}")
    return model_class


def build_model(config: HFMoefyConfig):
    """The moefied model ``config`` describes (see the module docstring)."""
    import transformers

    model_class = _model_class(config.model_class)
    folder = Path(config.hf_model) if config.hf_model else None
    if folder is not None and RECORD_KEY in json.loads((folder / "config.json").read_text(encoding="utf-8")):
        log.info("hf_moefy: %s is moefied: loaded as saved (match / num_experts / top_k ignored)", folder)
        return moetrain.moefy.from_pretrained(model_class, folder, dtype=torch.float32).train()
    if folder is None:
        hf_config = transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=128, bos_token_id=0, eos_token_id=0
        )
        model = transformers.GPT2LMHeadModel(hf_config)
    elif any(folder.glob("*.safetensors")) or (folder / "model.safetensors.index.json").is_file():
        model = model_class.from_pretrained(str(folder), dtype=torch.float32)
    else:
        hf_config = transformers.AutoConfig.from_pretrained(str(folder))
        factory = getattr(model_class, "from_config", None)
        model = factory(hf_config) if callable(factory) else model_class(hf_config)
    moetrain.moefy(model, match=config.match, num_experts=config.num_experts, top_k=config.top_k)
    return model.train()


class CountingBatches:
    """Counting sequences (see the module docstring) from a generator seeded per data stream; its
    state is the data position saved in checkpoints."""

    def __init__(self, vocab: int, seq_len: int, batch: int, seed: int, stream: int):
        self.vocab, self.seq_len, self.batch = vocab, seq_len, batch
        self.generator = torch.Generator().manual_seed(seed * 1_000_003 + stream)

    def _draw(self, count: int, generator: torch.Generator):
        start = torch.randint(0, self.vocab, (count, 1), generator=generator)
        step = torch.randint(1, 5, (count, 1), generator=generator)
        tokens = (start + step * torch.arange(self.seq_len + 1)) % self.vocab
        return {"input_ids": tokens[:, :-1]}, tokens[:, 1:]

    def next(self):
        return self._draw(self.batch, self.generator)

    def probe(self, sequences: int, seed: int):
        return self._draw(sequences, torch.Generator().manual_seed(seed))

    def reseed(self, seed: int, stream: int, step: int) -> None:
        self.generator.manual_seed((seed * 1_000_003 + stream) * 1_000_033 + step)

    @property
    def tokens_per_batch(self) -> int:
        return self.batch * self.seq_len

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


def next_token_loss(output, targets_BS: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.float().flatten(0, 1), targets_BS.flatten())


def build(train_config, shard):
    """The registry builder: (model, batches, loss function); ``shard``: this rank's data stream."""
    if train_config.data.source != "embedded":
        raise ValueError(
            f"data.source of model hf_moefy must be 'embedded', got {train_config.data.source!r}"
        )
    model = build_model(train_config.model)
    if shard.rank == 0:
        model.config.save_pretrained(Path(train_config.out_dir) / HF_CONFIG_DIR)
    model.config.use_cache = False  # training: no key/value cache in the outputs (not saved above)
    data = train_config.data
    batches = CountingBatches(
        model.config.vocab_size, data.seq_len, data.micro_batch_size, train_config.seed, shard.index
    )
    return model, batches, next_token_loss


register_model("hf_moefy", HFMoefyConfig, build)
