"""Traffic as a source (headway/adapt/traffic.py): request logs in their common shapes -> the
conversations up to the last user turn, deduplicated, over a rolling window; nothing but the
messages comes out."""

import json

import pytest

from headway.adapt.errors import AdaptError
from headway.adapt.traffic import (conversation, conversation_key, find_body, parse_time, read_requests, row_time,
                                   traffic_prompts, unique, window)

DAY = 86400.0
NOW = 1_800_000_000.0  # seconds since the epoch


def chat(*turns, **extra):
    roles = ["user", "assistant"]
    return {"model": "served-model", "user": "user-SECRET-7", "temperature": 0.7, **extra,
            "messages": [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]}


def write_log(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("row", [
    chat("hi"),
    {"request": chat("hi"), "request_id": "req-SECRET"},
    {"body": chat("hi"), "headers": {"authorization": "Bearer SECRET"}},
    {"request": {"body": chat("hi")}},
    {"body": json.dumps(chat("hi"))},  # a body logged as a JSON string
    {"timestamp": "2026-01-01T00:00:00Z", "payload": {"params": chat("hi")}},
])
def test_the_body_is_found_in_the_common_wrapper_shapes(row):
    body = find_body(row)
    assert body is not None and body["messages"][0]["content"] == "hi"


def test_a_row_without_messages_has_no_body():
    assert find_body({"prompt": "hi"}) is None
    assert find_body({"request": {"request": {"request": {"request": chat("too deep")}}}}) is None
    assert find_body(["not", "a", "row"]) is None


def test_the_conversation_is_cut_after_the_last_user_turn_and_keeps_only_roles_and_text():
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "a", "name": "SECRET"},
                {"role": "assistant", "content": "b"}, {"role": "user", "content": [{"type": "text", "text": "c"},
                                                                                   {"type": "text", "text": "d"}]},
                {"role": "assistant", "content": "an answer the target will rewrite"}]
    got, why = conversation(messages)
    assert why == "" and got == (("system", "Be brief."), ("user", "a"), ("assistant", "b"), ("user", "cd"))


@pytest.mark.parametrize("messages,why", [
    ([{"role": "user", "content": "a"}, {"role": "tool", "content": "{}"}], "role 'tool'"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "non-text content"),
    ([{"role": "system", "content": "s"}], "no user turn"),
    ([{"role": "user", "content": "   "}], "empty message"),
    (["not a message"], "malformed message"),
])
def test_unusable_conversations_say_why(messages, why):
    assert conversation(messages) == (None, why)


def test_duplicates_are_the_same_normalised_conversation_and_the_newest_wording_stays():
    a = conversation([{"role": "user", "content": "Hello   world\n"}])[0]
    b = conversation([{"role": "user", "content": " Hello world"}])[0]
    c = conversation([{"role": "user", "content": "hello world"}])[0]
    assert conversation_key(a) == conversation_key(b) != conversation_key(c)
    assert conversation_key(a) != conversation_key((("system", "Hello world"),))  # the role counts


@pytest.mark.parametrize("value,seconds", [
    (NOW, NOW), (int(NOW * 1000), NOW), ("2027-01-15T08:00:00Z", 1800000000.0),
    ("2027-01-15T09:00:00+01:00", 1800000000.0), ("2027-01-15T08:00:00", 1800000000.0),
    ("yesterday", None), (True, None), (None, None)])
def test_timestamps_read_as_seconds(value, seconds):
    assert parse_time(value) == seconds


def test_the_timestamp_may_sit_in_a_wrapper():
    assert row_time({"request": {"created": NOW}, "body": chat("x")}) == NOW
    assert row_time(chat("x")) is None


def test_logs_are_read_in_name_order_and_bad_rows_are_counted(tmp_path):
    write_log(tmp_path / "b.jsonl", [chat("second file")])
    write_log(tmp_path / "a.jsonl", [chat("first"), "{not json", {"prompt": "no messages"},
                                     {"messages": [{"role": "tool", "content": "x"}]}, ""])
    (tmp_path / "notes.txt").write_text(json.dumps(chat("not a log file")) + "\n")
    requests, stats = read_requests(tmp_path)
    assert [r.messages[-1][1] for r in requests] == ["first", "second file"]
    assert stats.files == 2 and stats.rows == 5 and stats.requests == 2 and stats.undated == 2
    assert dict(stats.skipped) == {"invalid JSON": 1, "no messages": 1, "role 'tool'": 1}
    with pytest.raises(AdaptError, match="traffic logs not found"):
        read_requests(tmp_path / "missing")


def test_the_window_keeps_the_newest_requests(tmp_path):
    log = write_log(tmp_path / "log.jsonl", [chat(f"q{i}") for i in range(10)])
    requests, _ = read_requests(log)
    assert [r.messages[0][1] for r in window(requests, 3, None, NOW)] == ["q7", "q8", "q9"]
    assert len(window(requests, None, None, NOW)) == 10


def test_the_window_in_days_uses_timestamps_and_keeps_undated_rows(tmp_path):
    rows = [chat("old", timestamp=NOW - 10 * DAY), chat("recent", created=NOW - DAY), chat("undated"),
            chat("new", ts=(NOW - 60) * 1000)]
    requests, _ = read_requests(write_log(tmp_path / "log.jsonl", rows))
    assert [r.messages[0][1] for r in window(requests, None, 2.0, NOW)] == ["recent", "undated", "new"]
    assert [r.messages[0][1] for r in window(requests, 2, 2.0, NOW)] == ["undated", "new"]


def test_dated_rows_are_ordered_by_time_not_by_file(tmp_path):
    rows = [chat("late", timestamp=NOW), chat("early", timestamp=NOW - 100), chat("middle", timestamp=NOW - 50)]
    requests, _ = read_requests(write_log(tmp_path / "log.jsonl", rows))
    assert [r.messages[0][1] for r in window(requests, 2, None, NOW)] == ["middle", "late"]


def test_unique_keeps_one_request_per_conversation_newest_first(tmp_path):
    rows = [chat("Same  question"), chat("other"), chat("same question"), chat("Same question ")]
    requests, _ = read_requests(write_log(tmp_path / "log.jsonl", rows))
    kept = unique(requests)
    assert [r.messages[0][1] for r in kept] == ["Same question ", "same question", "other"]


def test_traffic_prompts_are_rows_of_id_and_messages_only(tmp_path):
    rows = [{"request": chat("What is 2+2?", "4", "And 3+3?", "6"), "user_id": "SECRET", "ip": "10.0.0.1"},
            chat("What is 2+2?", "4", "And   3+3?"), chat("Write a haiku.", metadata={"tenant": "SECRET"})]
    kept, stats = traffic_prompts(write_log(tmp_path / "log.jsonl", rows), 100, None, NOW, limit=None)
    out = [r.row() for r in kept]
    assert stats.in_window == 3 and stats.unique == 2
    assert [set(r) for r in out] == [{"id", "messages"}] * 2
    assert all(set(m) == {"role", "content"} for r in out for m in r["messages"])
    assert out[1]["messages"] == [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
                                  {"role": "user", "content": "And   3+3?"}]
    assert all(r["id"].startswith("traffic:") and len(r["id"]) == 8 + 24 for r in out)
    assert "SECRET" not in json.dumps(out) and "10.0.0.1" not in json.dumps(out)
    limited, _ = traffic_prompts(tmp_path / "log.jsonl", 100, None, NOW, limit=1)
    assert [r.row() for r in limited] == out[:1]
