"""Generated documents and questions for the load test: varied, small, and never the same
bytes twice (the service answers a duplicate upload with 409)."""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, field

TOPICS: dict[str, list[str]] = {
    "backups": ["snapshot", "retention", "restore", "incremental", "archive", "checksum"],
    "networking": ["router", "subnet", "latency", "firewall", "gateway", "packet"],
    "billing": ["invoice", "refund", "subscription", "currency", "discount", "receipt"],
    "security": ["password", "rotation", "token", "audit", "encryption", "certificate"],
    "deployment": ["container", "rollback", "release", "canary", "replica", "migration"],
    "storage": ["volume", "quota", "bucket", "replication", "compression", "tier"],
    "support": ["ticket", "escalation", "priority", "response", "engineer", "handover"],
    "hiring": ["interview", "offer", "onboarding", "referral", "contract", "probation"],
}
VERBS = ["configure", "check", "schedule", "review", "approve", "disable", "measure", "document"]
TEMPLATES = [
    "To {verb} the {a}, open the {b} settings and follow the steps for {topic}.",
    "The {a} is kept for {n} days unless the {b} policy says otherwise.",
    "Every {a} must be reviewed by the {topic} team before the {b} changes.",
    "If the {a} fails, {verb} the {b} and retry after {n} minutes.",
    "Operators {verb} each {a} weekly; a missing {b} raises an alert.",
    "Our {topic} handbook limits one {a} per {b}, with {n} exceptions a year.",
]
QUESTIONS = [
    "How do I {verb} the {a}?",
    "How long is the {a} kept?",
    "Who reviews a {a} before the {b} changes?",
    "What happens if the {a} fails?",
    "What is the limit on {a} per {b} in {topic}?",
]


@dataclass(slots=True)
class GeneratedDocument:
    """One document to upload: a title, markdown text and the topic it is about."""

    title: str
    text: str
    topic: str


@dataclass(slots=True)
class Corpus:
    """Makes unique documents (a per-corpus nonce plus a counter) and questions about them."""

    nonce: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    num_made: int = 0

    def document(self, rng: random.Random, num_sections: int | None = None) -> GeneratedDocument:
        """A new markdown document of 1-4 sections on a random topic."""
        topic = rng.choice(sorted(TOPICS))
        self.num_made += 1
        title = f"{topic.title()} note {self.nonce}-{self.num_made}"
        parts = [f"# {title}\n"]
        for i in range(num_sections or rng.randint(1, 4)):
            parts.append(f"## {topic.title()} part {i + 1}\n")
            sentences = [_fill(rng.choice(TEMPLATES), topic, rng) for _ in range(rng.randint(3, 8))]
            parts.append(" ".join(sentences) + "\n")
        return GeneratedDocument(title=title, text="\n".join(parts), topic=topic)

    def question(self, rng: random.Random) -> str:
        """A question in the corpus's vocabulary (what a reader of these documents asks)."""
        topic = rng.choice(sorted(TOPICS))
        return _fill(rng.choice(QUESTIONS), topic, rng)


def _fill(template: str, topic: str, rng: random.Random) -> str:
    a, b = rng.sample(TOPICS[topic], 2)
    return template.format(a=a, b=b, topic=topic, verb=rng.choice(VERBS), n=rng.randint(2, 90))
