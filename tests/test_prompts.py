"""Your own prompts (rla_lib.prompts): the three line forms, every malformed line named by its number, chats rendered
with the checkpoint's template as vLLM's `chat` renders them, and prompts that leave no room to answer refused."""

import json
import shutil

import pytest

from rla_lib import task
from rla_lib.models import load_tokenizer, resolve_model
from rla_lib.paths import ROOT
from rla_lib.prompts import check_room, prompt_ids, read_prompts

# A template the embedded tokenizer can spell (digits, + - * = and space): the turns' text, then "=" to answer after
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"


def with_chat_template(tmp_path, model="qwen3-tiny"):
    """A copy of a checkpoint (an embedded name or a folder) whose tokenizer has a chat template (the folder keeps the
    checkpoint's name)."""
    source = resolve_model(str(model)).path
    path = shutil.copytree(source, tmp_path / "chat" / source.name)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": TEMPLATE}))
    return path


def write(tmp_path, *lines):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_three_forms_and_blank_lines(tmp_path):
    chat = [{"role": "system", "content": "1+"}, {"role": "user", "content": "2+3"}]
    path = write(tmp_path, '"1+2="', "", json.dumps({"prompt": "3+4="}), json.dumps({"messages": chat}))
    assert read_prompts(path) == ["1+2=", "3+4=", chat]


@pytest.mark.parametrize("line, message", [
    ("1+2=", ":2: not JSON"),
    ('{"text": "1+2="}', ":2: expected a JSON string"),
    ('{"prompt": ""}', ":2: an empty prompt"),
    ('{"messages": []}', ":2: expected a JSON string"),
    ('{"messages": [{"role": "robot", "content": "1"}]}', ":2: a message must be"),
    ('{"messages": [{"role": "user", "content": 1}]}', ":2: a message must be"),
    ('{"prompt": "1=", "answer": 1}', ":2: expected a JSON string"),
])
def test_a_bad_line_is_named_by_its_number(tmp_path, line, message):
    with pytest.raises(ValueError, match=message):
        read_prompts(write(tmp_path, '"1+2="', line))


def test_a_missing_or_empty_file_says_what_to_give(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist: give a JSON-lines file"):
        read_prompts(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="holds no prompt"):
        read_prompts(write(tmp_path, "", "  "))


def test_a_chat_is_rendered_with_the_template_and_text_is_encoded_as_is(tmp_path):
    tokenizer = load_tokenizer(with_chat_template(tmp_path))
    chat = [{"role": "user", "content": "12+30"}]
    ids = prompt_ids(["12+30=", chat, [2, 3]], tokenizer)
    assert ids[0] == tokenizer.encode("12+30=")
    assert ids[1] == ids[0]  # the template added the "=" the text prompt spelled out
    assert ids[2] == [2, 3]  # token ids pass through


def test_a_chat_without_a_template_is_refused():
    with pytest.raises(ValueError, match="has no chat template"):
        prompt_ids([[{"role": "user", "content": "1+2"}]], load_tokenizer("qwen3-tiny"), "qwen3-tiny")


def test_a_prompt_must_leave_room_to_answer():
    check_room([[1] * 32], max_tokens=32, context=64)
    with pytest.raises(ValueError, match="prompt 2 has 33 tokens; with 32 to generate it does not fit"):
        check_room([[1], [1] * 33], max_tokens=32, context=64)


def test_the_shipped_example_prompts_are_a_fresh_task_split():
    """data/prompts/sums-64.jsonl (the README's `rla measure` example) is the task's split of seed 64, as text."""
    shipped = read_prompts(ROOT / "data" / "prompts" / "sums-64.jsonl")
    assert shipped == [p.prompt for p in task.make_split(64, 64)]
