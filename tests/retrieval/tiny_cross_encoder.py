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
    """A 1-layer BERT with the embedder's tokenizer, trained `steps` steps; saved to out_dir.
    Raises RuntimeError if it has not learned the toy task (tests that use it would fail for
    a reason that is not theirs)."""
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
        # no dropout, and a learning rate of 3e-3: at 1e-2 the model learned the task by step
        # 50 and then collapsed to one constant score by step 200 on one CPU (AVX-512) and not
        # on others, where float rounding took another path
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = BertForSequenceClassification(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
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
    check = random.Random(1)  # pairs it did not train on
    held_out = [toy_pair(check) for _ in range(64)]
    enc = tokenizer(
        [q for q, _, _ in held_out], [p for _, p, _ in held_out], padding=True, return_tensors="pt"
    )
    with torch.no_grad():
        scores = model(**enc).logits[:, 0]
    labels = torch.tensor([y for _, _, y in held_out])
    margin = float(scores[labels == 1].min() - scores[labels == 0].max())
    if margin < 1.0:
        raise RuntimeError(f"the tiny cross-encoder did not learn its toy task (margin {margin})")
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
