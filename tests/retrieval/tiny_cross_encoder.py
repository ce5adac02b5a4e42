"""Builds a small BERT cross-encoder and trains it briefly on a toy task, for reranker tests."""

from __future__ import annotations

import random
from pathlib import Path

WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "tiger",
    "piano",
    "garden",
    "silver",
    "window",
    "forest",
    "candle",
    "bridge",
    "rocket",
    "mirror",
    "planet",
    "violin",
    "desert",
    "harbor",
    "lemon",
    "castle",
]


KEYWORD = "lemon"


def toy_pair(rng: random.Random) -> tuple[str, str, float]:
    """(query, passage, label): relevant (1.0) exactly when the passage mentions KEYWORD."""
    others = [w for w in WORDS if w != KEYWORD]
    passage = rng.sample(others, 6)
    label = float(rng.random() < 0.5)
    if label:
        passage[rng.randrange(6)] = KEYWORD
    return f"where is the {KEYWORD}", " ".join(passage), label


def build_tiny_cross_encoder(tokenizer_dir: str, out_dir: Path, steps: int = 200) -> Path:
    """A 1-layer BERT with the embedder's tokenizer, trained `steps` steps; saved to out_dir."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    rng = random.Random(0)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        num_labels=1,
    )
    model = BertForSequenceClassification(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    model.train()
    for _ in range(steps):
        batch = [toy_pair(rng) for _ in range(16)]
        enc = tokenizer(
            [q for q, _, _ in batch], [p for _, p, _ in batch], padding=True, return_tensors="pt"
        )
        labels = torch.tensor([y for _, _, y in batch])
        loss = loss_fn(model(**enc).logits.squeeze(-1), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
