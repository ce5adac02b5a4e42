"""PREFIXRAG_REPLICAS=2 on a real local Ray cluster: both engine replicas serve /v1/query and
the OpenAI routes, and a conversation's follow-ups go to the replica that cached its prefix.

Which replica served a request is read from the per-replica /metrics series (prompt tokens
each replica looked up); that it was the right one is proven by the follow-up's cache hit,
which only the replica holding the earlier turn can give.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import ray
from fastapi.testclient import TestClient

from prefixrag.app.main import create_app
from tests.app.conftest import LOAD_TIMEOUT_S, app_state
from tests.app.qa_helpers import ingest_docs, qa_settings

pytestmark = pytest.mark.slow

QUERIED = re.compile(r'^prefixrag_prefix_cache_queried_tokens_total\{replica="([^"]+)"\} (\S+)$')


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest, embedder):
    settings = qa_settings(
        tmp_path_factory.mktemp("replica-data"),
        request,
        replicas=2,
        replica_num_cpus=0.5,
        chunk_disk_gb=0,
    )
    with TestClient(create_app(settings, embedder=embedder)) as client:
        if not app_state(client).wait_loaded(LOAD_TIMEOUT_S * 3):
            raise TimeoutError("the app did not finish loading")
        assert app_state(client).snapshot()["llm"] == "ok", app_state(client).snapshot()
        yield client, ingest_docs(client)


def queried_by_replica(client: TestClient) -> dict[str, float]:
    """Prompt tokens each replica has looked up in its prefix cache, from /metrics."""
    text = client.get("/metrics").text
    found = {}
    for line in text.splitlines():
        match = QUERIED.match(line)
        if match:
            found[match.group(1)] = float(match.group(2))
    return found


def served_by(client: TestClient, send: Any) -> tuple[str, Any]:
    """The one replica that looked up tokens while ``send()`` ran, and what it returned."""
    before = queried_by_replica(client)
    out = send()
    after = queried_by_replica(client)
    grew = [name for name in after if after[name] > before.get(name, 0.0)]
    assert len(grew) == 1, (before, after)
    return grew[0], out


def ask(client: TestClient, question: str, history: list[dict[str, Any]]) -> dict[str, Any]:
    body = {"question": question, "top_k": 3, "max_tokens": 6, "temperature": 0}
    response = client.post("/v1/query", json={**body, "history": history})
    assert response.status_code == 200, response.text
    return response.json()


def test_readyz_lists_every_replica_running(cluster):
    client, _ = cluster
    body = client.get("/readyz").json()
    assert body["status"] == "ok"
    replicas = body["replicas"]
    assert len(replicas) == 2
    assert all(r["state"].endswith("RUNNING") for r in replicas)
    assert sorted(r["name"] for r in replicas) == ["replica-0", "replica-1"]
    assert set(queried_by_replica(client)) == {"replica-0", "replica-1"}


def test_query_conversations_stick_to_a_replica_and_both_replicas_serve(cluster):
    client, _ = cluster
    block_size = app_state(client).settings.block_size
    conversations = [
        ["Why did ships need the lighthouse beam?", "What did the keeper write down?"],
        ["How do tomatoes grow well?", "What keeps the roots healthy?"],
    ]
    homes = []
    for questions in conversations:
        history: list[dict[str, Any]] = []
        replicas = []
        previous = None
        for question in questions:
            replica, out = served_by(client, lambda q=question, h=history: ask(client, q, h))
            replicas.append(replica)
            if previous is not None:
                # the last turn's prompt and answer came from this replica's cache
                computed = previous["prompt_tokens"] + previous["completion_tokens"] - 1
                assert out["usage"]["cached_tokens"] >= computed // block_size * block_size
            previous = out["usage"]
            history.append(
                {"question": question, "answer": out["answer"], "chunk_ids": out["chunk_ids"]}
            )
        assert len(set(replicas)) == 1, replicas
        homes.append(replicas[0])
    assert sorted(homes) == ["replica-0", "replica-1"]


def test_openai_chat_follow_up_sticks_to_its_replica(cluster):
    client, _ = cluster
    messages = [{"role": "user", "content": "Name one thing a lighthouse keeper might do."}]
    body = {"model": "SmolLM2-135M-Instruct.Q4_1", "max_tokens": 8, "temperature": 0}

    def chat() -> dict[str, Any]:
        response = client.post("/v1/chat/completions", json={**body, "messages": messages})
        assert response.status_code == 200, response.text
        return response.json()

    first_home, first = served_by(client, chat)
    messages.append({"role": "assistant", "content": first["choices"][0]["message"]["content"]})
    messages.append({"role": "user", "content": "And in the morning?"})
    second_home, second = served_by(client, chat)
    assert second_home == first_home
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"] // 16 * 16 - 16


def chunk_entries_by_replica(client: TestClient) -> dict[str, float]:
    """Chunk KV entries each replica holds in its pool and host tiers, from /metrics."""
    pattern = re.compile(
        r'^prefixrag_chunk_store_entries\{replica="([^"]+)",tier="(pool|host)"\} (\S+)$'
    )
    found: dict[str, float] = {}
    for line in client.get("/metrics").text.splitlines():
        match = pattern.match(line)
        if match:
            found[match.group(1)] = found.get(match.group(1), 0.0) + float(match.group(3))
    return found


def long_completion(client: TestClient, prompt: str) -> Any:
    # a raw prompt (no chat template): two of them share no leading block, so each goes to
    # the least-loaded replica
    body = {
        "model": "SmolLM2-135M-Instruct.Q4_1",
        "prompt": prompt,
        "max_tokens": 200,
        "ignore_eos": True,
        "temperature": 0,
    }
    return client.post("/v1/completions", json=body)


def replicas_of(client: TestClient) -> list[dict[str, Any]]:
    return client.get("/readyz").json().get("replicas", [])


def wait_for(condition: Any, timeout_s: float, what: str) -> None:
    """Poll ``condition()`` until true (a state to reach, not a race to hide)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} (in {timeout_s} s)")
        time.sleep(0.25)


def test_a_replica_killed_mid_request_fails_only_its_requests(cluster):
    client, _ = cluster
    with ThreadPoolExecutor(2) as pool:
        prompts = ("Foxes live in dens and", "Oceans cover most of the planet and")
        futures = [pool.submit(long_completion, client, prompt) for prompt in prompts]
        # both long generations are running, one on each replica
        wait_for(
            lambda: sorted(r.get("num_active", 0) for r in replicas_of(client)) == [1, 1],
            60,
            "the two generations did not start on two replicas: "
            + repr([(r.get("name"), r.get("num_active")) for r in replicas_of(client)]),
        )
        victim = replicas_of(client)[0]
        ray.kill(ray.get_actor(victim["actor_name"], namespace="serve"), no_restart=False)
        responses = sorted((f.result(timeout=120) for f in futures), key=lambda r: r.status_code)
    assert [r.status_code for r in responses] == [200, 503], [r.text for r in responses]
    assert responses[1].headers["Retry-After"].isdigit()
    assert "retry" in responses[1].json()["error"]["message"]
    # Serve replaces the dead replica; the service answers on both again
    wait_for(
        lambda: sum(r["state"].endswith("RUNNING") for r in replicas_of(client)) == 2,
        90,
        "the dead replica was not replaced",
    )
    live = {r["replica_id"] for r in replicas_of(client)}
    assert victim["replica_id"] not in live
    for topic in ("a fox", "the sea", "a cat"):
        response = client.post(
            "/v1/chat/completions",
            json={
                "model": "SmolLM2-135M-Instruct.Q4_1",
                "messages": [{"role": "user", "content": f"One word about {topic}."}],
                "max_tokens": 4,
            },
        )
        assert response.status_code == 200, response.text


def test_a_delete_while_a_replica_restarts_succeeds_and_is_replayed_to_it(cluster):
    client, _ = cluster
    note = b"# Lighthouse log\n\nThe keeper of the north light wound the clock at dusk.\n"
    response = client.post("/v1/documents?wait=true", files={"file": ("log.md", note, "text/md")})
    assert response.status_code == 201, response.text
    document_id = response.json()["id"]
    victim = replicas_of(client)[0]
    ray.kill(ray.get_actor(victim["actor_name"], namespace="serve"), no_restart=False)
    # the delete reaches the rows at once; the dead replica cannot drop its chunk KV now, which
    # must not fail the delete (the document is gone from the database either way)
    response = client.delete(f"/v1/documents/{document_id}")
    assert response.status_code == 204, response.text
    assert client.get(f"/v1/documents/{document_id}").status_code == 404
    wait_for(
        lambda: (
            sum(r["state"].endswith("RUNNING") for r in replicas_of(client)) == 2
            and victim["replica_id"] not in {r["replica_id"] for r in replicas_of(client)}
        ),
        90,
        "the dead replica was not replaced",
    )
    # describing the new replica (/readyz did) replayed the drops it missed
    engine = app_state(client).llm.engine
    running = {r["replica_id"] for r in replicas_of(client)}
    assert running <= engine._synced, (running, engine._synced)
    assert engine._drop_log[-1][1].endswith(str(document_id))


def test_deleting_every_document_drops_its_chunk_kv_on_every_replica(cluster):
    client, ids = cluster
    # new conversations spread over the replicas until both hold source KV
    questions = iter(
        [
            "What do aphids do to leaves?",
            "What happens to aircraft after an eruption?",
            "What did the keeper light each evening?",
            "Which soil keeps roots healthy?",
        ]
    )
    before = chunk_entries_by_replica(client)
    while not (len(before) == 2 and all(n > 0 for n in before.values())):
        ask(client, next(questions), [])
        before = chunk_entries_by_replica(client)
    assert len(before) == 2 and all(n > 0 for n in before.values()), before
    for document_id in ids.values():
        response = client.delete(f"/v1/documents/{document_id}")
        assert response.status_code == 204, response.text
    assert chunk_entries_by_replica(client) == {name: 0.0 for name in before}
