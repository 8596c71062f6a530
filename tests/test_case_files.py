"""The built-in case files: where they live, one file per check family, and the tier scope (``models_full``)."""

import dataclasses
from pathlib import Path

import pytest

from kvconform.cases import CaseFileError, builtin_cases_dir, load_case_file, load_cases
from kvconform.checks import load_checks

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def registry():
    return load_checks()


@pytest.fixture(scope="module")
def builtin(registry):
    return load_cases(known_checks=set(registry))


def test_builtin_cases_come_from_the_checkout_folder():
    # tests run from a source checkout (PYTHONPATH or an editable install): the top-level folder, not a copy
    # installed elsewhere
    assert builtin_cases_dir() == REPO / "conformance_cases"


def test_one_case_file_per_check_family_and_every_case_in_its_family_file(registry, builtin):
    families = {check.family for check in registry.values()}
    files = {p.stem for p in builtin_cases_dir().glob("*.toml")}
    assert files == families, f"case files {sorted(files)} vs check families {sorted(families)}"
    misplaced = [f"{c.id} ({c.check}, family {registry[c.check].family}) is in {Path(c.source).name}"
                 for c in builtin if Path(c.source).name != f"{registry[c.check].family}.toml"]
    assert not misplaced, "cases outside their family's file: " + "; ".join(misplaced)


def test_no_twin_cases(builtin):
    """A case that differs from another only in its model scope, tier or description is a twin: widen the first
    one's scope in the full tier with ``models_full`` instead."""
    scope_fields = {"id", "source", "description", "models", "models_full", "tier"}

    def scenario(case):
        fields = {k: v for k, v in dataclasses.asdict(case).items() if k not in scope_fields}
        return repr(sorted(fields.items()))

    seen = {}
    twins = []
    for case in builtin:
        key = scenario(case)
        if key in seen:
            twins.append((seen[key], case.id))
        seen.setdefault(key, case.id)
    assert not twins, f"twin cases (use models_full): {twins}"


def test_models_full_widens_the_scope_in_the_full_tier_only(builtin):
    by_id = {c.id: c for c in builtin}
    crop_short = by_id["crop_short"]
    assert crop_short.model_scope(full=False) == ("llama", "gemma3", "t5")
    assert crop_short.model_scope(full=True) == ()  # "all"
    speed = by_id["speed_vs_uncached"]
    assert speed.model_scope(full=False) == ("llama",)
    assert "mistral" in speed.model_scope(full=True) and "gpt2" not in speed.model_scope(full=True)
    assert by_id["crop_zero"].model_scope(full=True) == ("llama", "gemma3")  # no models_full: same in both tiers


def test_session_items_follow_the_tier_scope():
    from kvconform.session import build_session

    def models_of(full):
        session = build_session(models=["llama", "mistral", "mamba2"], case_ids=["crop_short"], full=full)
        return sorted({item.model.name for item in session.items() if item.subject.name == "ReferenceCache"})

    assert models_of(full=False) == ["llama"]
    assert models_of(full=True) == ["llama", "mamba2", "mistral"]


@pytest.mark.parametrize("body, problem", [
    ('models = ["llama"]\nmodels_full = "all"\ntier = "full"', "only for default-tier cases"),
    ('models_full = "all"', "already runs on every model"),
    ('models = ["llama", "t5"]\nmodels_full = ["llama", "mistral"]', "missing ['t5']"),
    ('models = ["llama"]\nmodels_full = "every"', 'expected "all" or a non-empty list'),
    ('models = ["llama"]\nmodels_full = []', 'expected "all" or a non-empty list'),
    ('models = ["llama"]\nmodels_full = 3', "expected list/str"),
])
def test_bad_models_full_names_file_case_and_key(tmp_path, body, problem):
    path = tmp_path / "mine.toml"
    path.write_text(f'[[case]]\nid = "c1"\ncheck = "check_prefill_then_decode"\nops = ["prefill 4"]\n{body}\n')
    with pytest.raises(CaseFileError) as err:
        load_case_file(path)
    assert "mine.toml" in str(err.value) and "case 'c1'" in str(err.value) and "'models_full'" in str(err.value)
    assert problem in str(err.value)
