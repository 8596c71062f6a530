"""Model repositories that ship their own code: refused without explicit consent (never a prompt), and with it their
own cache classes become subjects, a faulty one caught with its file and class named, a correct one passing."""

import re
import json
import subprocess
import sys

import pytest

from kvconform.outcomes import UsageError

CONFIGURATION = '''
from transformers import LlamaConfig


class RepoConfig(LlamaConfig):
    model_type = "{model_type}"
'''

MODELING = '''
import inspect

import torch
from transformers import DynamicCache, LlamaForCausalLM

from .configuration_repo import RepoConfig


class RepoCache(DynamicCache):
    """The repository's own cache: a DynamicCache that also counts tokens per batch row."""

    def __init__(self, config=None, **kwargs):
        super().__init__(config=config)
        self.row_tokens = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx == 0:
            if self.row_tokens is None or self.row_tokens.shape[0] != key_states.shape[0]:
                self.row_tokens = torch.zeros(key_states.shape[0], dtype=torch.long)
            self.row_tokens += key_states.shape[-2]
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def reorder_cache(self, beam_idx):
        layers = self.layers[: max(1, len(self.layers) // 2)] if {faulty} else self.layers
        for layer in layers:
            layer.reorder_cache(beam_idx)
        if self.row_tokens is not None:
            self.row_tokens = self.row_tokens[beam_idx.cpu()]


class RepoSlimCache(DynamicCache):
    """Defined by the repository's code but not created by its model: a subject too."""


class RepoForCausalLM(LlamaForCausalLM):
    config_class = RepoConfig

    def forward(self, input_ids=None, use_cache=None, **kwargs):
        key = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"
        if kwargs.get("past_key_values") is not None and key == "cache":
            kwargs["cache"] = kwargs.pop("past_key_values")
        if use_cache is not False and kwargs.get(key) is None:
            kwargs[key] = RepoCache(config=self.config)
        return super().forward(input_ids=input_ids, use_cache=use_cache, **kwargs)
'''


def write_repository(folder, faulty: bool) -> str:
    """Write a tiny model repository with its own code (config.json ``auto_map``) into ``folder``: a 2-layer llama
    whose model creates ``RepoCache`` itself; ``faulty``: its ``reorder_cache`` moves only the first half of the
    layers (the other layers keep the old row order). Returns the folder as a string."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir()
    model_type = f"kvconform_repo_{folder.name}"
    (folder / "configuration_repo.py").write_text(CONFIGURATION.format(model_type=model_type))
    (folder / "modeling_repo.py").write_text(MODELING.format(faulty=faulty))
    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=128, max_position_embeddings=256, initializer_range=0.1)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    data = json.loads((folder / "config.json").read_text())
    data.update(model_type=model_type, architectures=["RepoForCausalLM"],
                auto_map={"AutoConfig": "configuration_repo.RepoConfig",
                          "AutoModelForCausalLM": "modeling_repo.RepoForCausalLM"})
    (folder / "config.json").write_text(json.dumps(data))
    return str(folder)


@pytest.fixture(scope="module")
def repositories(tmp_path_factory):
    base = tmp_path_factory.mktemp("repos")
    return write_repository(base / "faulty_repo", faulty=True), write_repository(base / "correct_repo", faulty=False)


def test_repository_code_is_refused_without_consent_and_never_prompts(repositories):
    from kvconform.session import build_session

    faulty, _ = repositories
    with pytest.raises(UsageError) as err:
        build_session(models=[faulty], builtin=False, checks=["check_reorder_then_decode"])
    text = str(err.value)
    assert "--kvconform-trust-remote-code" in text and "configuration_repo.py, modeling_repo.py" in text
    # a real run with stdin closed: exit 4 with that message, no interactive prompt
    run = subprocess.run([sys.executable, "-m", "pytest", "--kvconform", "-p", "no:cacheprovider",
                          "--kvconform-model", faulty], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                         timeout=300, cwd=str(repositories[0].rpartition("/")[0]))
    assert run.returncode == 4, run.stdout + run.stderr
    assert "--kvconform-trust-remote-code" in run.stderr and "modeling_repo.py" in run.stderr
    assert "[y/N]" not in run.stdout + run.stderr


def test_repository_cache_classes_become_subjects_and_the_faulty_one_is_caught(repositories):
    from kvconform.checks import ConformanceError
    from kvconform.session import build_session

    faulty, correct = repositories
    session = build_session(models=[faulty, correct], builtin=False, trust_remote_code=True,
                            checks=["check_reorder_then_decode"])
    names = [s.name for s in session.subjects]
    assert names == ["faulty_repo.RepoCache", "faulty_repo.RepoSlimCache", "correct_repo.RepoCache",
                     "correct_repo.RepoSlimCache"]
    assert any("subject faulty_repo.RepoCache (class RepoCache, created by the model" in line
               for line in session.header_lines())
    items = [i for i in session.items() if not i.skip and i.subject.name.endswith(".RepoCache")]
    assert {i.model.name for i in items} == {"faulty_repo", "correct_repo"}
    assert all(i.subject.name.startswith(i.model.name + ".") for i in items)  # each runs on its own model only
    outcomes = {}
    for item in items:
        try:
            session.run(item)
            outcomes[item.id] = "passed"
        except ConformanceError as exc:
            outcomes[item.id] = str(exc)
    for item_id, outcome in outcomes.items():
        if item_id.startswith("correct_repo."):
            assert outcome == "passed", outcome
        else:
            # the beam reorder (rows rolled) and the beam swap (two rows exchanged) both blame reorder_cache()
            assert re.search(r"reorder_cache\(\).*did not move every tensor", outcome), outcome
            assert "subject: class RepoCache of " in outcome and "faulty_repo/modeling_repo.py" in outcome
            assert "--kvconform-trust-remote-code" in outcome.splitlines()[-1]
    assert any(k.startswith("faulty_repo.") for k in outcomes) and any(k.startswith("correct_repo.") for k in outcomes)
