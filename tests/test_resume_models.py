"""A resume refuses models re-exported with other weights at the same path (the reference, the
reward model, the critic's initialisation, the tokenizer: ``fingerprint.py``), unless
``run.allow_changed_models``; a LoRA adapter on a base of another shape is refused in one line."""

import json
import re
import shutil

import pytest
import torch

from conftest import WORDS, make_models
from oppo.checkpoint import MANIFEST_FILE, MODELS_FILE, latest_checkpoint, verify_checkpoint
from oppo.cli import main
from oppo.config import load_config
from oppo.fingerprint import tokenizer_fingerprint, weights_fingerprint
from oppo.models import ModelLoadError
from oppo.run import train


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_prompts):
    """Own copies of the tiny models (the tests overwrite them; :func:`case` restores them), the
    reference in a directory of its own, and a run of one step on them (trained once: each test
    resumes a copy)."""
    root = tmp_path_factory.mktemp("resume_models")
    models = make_models(root / "models")
    models["reference"] = root / "models" / "reference"
    shutil.copytree(models["policy"], models["reference"])
    shutil.copytree(root / "models", root / "pristine")
    run(models, tiny_prompts, root / "run", 1)
    return models, root


@pytest.fixture
def case(trained, tmp_path, capsys):
    """(the models, a copy of the trained run's directory); the models are restored afterwards."""
    models, root = trained
    out = tmp_path / "run"
    shutil.copytree(root / "run", out)  # (run.out_dir may change on resume)
    capsys.readouterr()
    yield models, out
    shutil.rmtree(root / "models")
    shutil.copytree(root / "pristine", root / "models")


def settings(models, prompts, out, steps, *extra):
    return [f"policy.path={models['policy']}", f"reward.path={models['reward']}",
            f"reference.path={models['reference']}", f"data.prompts={prompts}", "placement.threads=1",
            "overlap.mode=sequential", "ppo.batch_size=2", "ppo.minibatch_size=2", "ppo.micro_batch_size=2",
            "generation.max_new_tokens=4", f"run.steps={steps}", f"run.out_dir={out}", "log.progress=false",
            "run.samples=0", *extra]


def run(models, prompts, out, steps, *extra, resume=None):
    return train(load_config(None, settings(models, prompts, out, steps, *extra)), resume=resume, progress=False)


def snapshot(d):
    return {str(p.relative_to(d)): (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(d.rglob("*")) if p.is_file()}


def overwrite_with_other_weights(model_dir, tmp_path, **shape):
    """Re-export ``model_dir`` (a policy-like directory) with the weights of another initialisation."""
    other = make_models(tmp_path / "other", seed=1, **shape)
    for f in model_dir.iterdir():
        if f.suffix in (".safetensors", ".json") and "token" not in f.name:
            f.unlink()
    for f in other["policy"].iterdir():
        if f.suffix in (".safetensors", ".json") and "token" not in f.name:
            shutil.copy(f, model_dir / f.name)


def test_fingerprints_are_recorded_and_an_unchanged_resume_passes(case, tiny_prompts):
    models, out = case
    ckpt = latest_checkpoint(out)
    saved = json.loads((ckpt / MODELS_FILE).read_text())
    assert set(saved) == {"reference", "reward", "critic", "tokenizer", "prompts"}  # (no chat template used)
    assert saved["prompts"]["path"] == str(tiny_prompts) and saved["prompts"]["fingerprint"].startswith("p1:")
    assert saved["reference"]["path"] == str(models["reference"])
    assert MODELS_FILE in json.loads((ckpt / MANIFEST_FILE).read_text())  # written before the manifest
    run(models, tiny_prompts, out, 2, resume="auto")
    assert latest_checkpoint(out).name == "step_000002"


def error_line(capsys) -> str:
    """The refusal: stderr's last line, after nothing but the run's start-up lines (threads, an
    oversubscription warning, the models loading and their time)."""
    *start, err = capsys.readouterr().err.strip().splitlines()
    assert all(line.startswith(("threads:", "oppo: warning: the machine is oversubscribed", "loading models:",
                                "models loaded in")) for line in start), start
    return err


def test_changed_reference_is_refused_with_one_paragraph_and_nothing_changes(case, tiny_prompts, tmp_path, capsys):
    models, out = case
    before = snapshot(out)
    overwrite_with_other_weights(models["reference"], tmp_path)
    assert main(["train", "--resume", "auto", *settings(models, tiny_prompts, out, 2)]) == 2
    err = error_line(capsys)
    assert err.startswith("oppo: error: cannot resume from") and "Traceback" not in err
    assert f"the reference model at {models['reference']}" in err
    assert "reward model" not in err and "tokenizer" not in err
    assert "Restore the original files" in err and "run.allow_changed_models=true" in err
    assert snapshot(out) == before, "the refused resume changed the run directory"


def test_changed_reference_resumes_with_the_override(case, tiny_prompts, tmp_path):
    models, out = case
    overwrite_with_other_weights(models["reference"], tmp_path)
    with pytest.warns(UserWarning, match=f"the reference model at {models['reference']}"):
        run(models, tiny_prompts, out, 2, "run.allow_changed_models=true", resume="auto")
    ckpt = latest_checkpoint(out)
    assert ckpt.name == "step_000002"
    # the continued run records the models it now reads: resuming it again needs no override
    run(models, tiny_prompts, out, 3, resume="auto")


def test_changed_tokenizer_is_refused(case, tiny_prompts):
    from tokenizers import Tokenizer, models as tk_models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    models, out = case
    words = list(WORDS)
    words[0], words[1] = words[1], words[0]  # the same size, two ids swapped: the model still loads
    tk = Tokenizer(tk_models.WordLevel(vocab={t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>"] + words)},
                                       unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    for role in ("policy", "reward", "reference"):  # all alike (a mismatch between roles has its own error)
        tok.save_pretrained(models[role])
    with pytest.raises(ModelLoadError, match=f"the policy's tokenizer at {models['policy']}") as e:
        run(models, tiny_prompts, out, 2, resume="auto")
    assert "reference model" not in str(e.value)


def test_checkpoint_without_fingerprints_resumes_unchecked(case, tiny_prompts, tmp_path):
    models, out = case
    ckpt = latest_checkpoint(out)
    (ckpt / MODELS_FILE).unlink()  # as a checkpoint written before fingerprints
    manifest = json.loads((ckpt / MANIFEST_FILE).read_text())
    del manifest[MODELS_FILE]
    (ckpt / MANIFEST_FILE).write_text(json.dumps(manifest))
    assert verify_checkpoint(ckpt) is None
    overwrite_with_other_weights(models["reference"], tmp_path)
    run(models, tiny_prompts, out, 2, resume="auto")
    assert latest_checkpoint(out).name == "step_000002"


def test_lora_adapter_on_a_base_of_another_shape_is_one_line(tiny_prompts, tmp_path, capsys):
    models = make_models(tmp_path / "models")
    models["reference"] = models["policy"]  # (LoRA: the reference is the policy's base)
    out = tmp_path / "run"
    lora = ("lora.r=2", "lora.alpha=4")
    run(models, tiny_prompts, out, 1, *lora)
    capsys.readouterr()
    overwrite_with_other_weights(models["policy"], tmp_path, hidden=64)
    assert main(["train", "--resume", "auto", *settings(models, tiny_prompts, out, 2, *lora)]) == 2
    err = error_line(capsys)
    assert "Traceback" not in err
    assert err.startswith(f"oppo: error: the LoRA adapter in {latest_checkpoint(out) / 'policy'}")
    # (the first of them: down_proj's input is the MLP's width, 64 then and 128 now)
    assert re.search(r"layers\.0\.mlp\.down_proj\.lora_A\.weight is \[2, 64\] there and \[2, 128\] here "
                     r"\(and \d+ more parameters\)", err), err
    assert "Resume with the base model the run started from" in err


def test_fingerprints_see_one_changed_value_and_not_the_device(tiny_models):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_models["policy"])
    before = weights_fingerprint(model)
    assert weights_fingerprint(AutoModelForCausalLM.from_pretrained(tiny_models["policy"])) == before
    if torch.cuda.is_available():  # the same on any device: the bytes are hashed on the host
        assert weights_fingerprint(model.cuda()) == before
        model.cpu()
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 5] += 1e-3  # one value, likely not in the sample
    assert weights_fingerprint(model) != before
    tok = AutoTokenizer.from_pretrained(tiny_models["policy"])
    fp = tokenizer_fingerprint(tok)
    tok(["the film", "a"], padding=True)  # encoding with padding sets the backend's padding state
    assert tokenizer_fingerprint(tok) == fp


def _module(**tensors) -> torch.nn.Module:
    m = torch.nn.Module()
    for name, t in tensors.items():
        m.register_buffer(name, t)
    return m


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fingerprints_see_a_value_move(dtype):
    """Swapping two rows of embed_tokens and lm_head, or +k and -k in one lane of the 8-byte words
    (equal sums of words), changed nothing under the old sum-and-samples fingerprint."""
    g = torch.Generator().manual_seed(0)
    embed, head = (torch.randn(64, 16, generator=g).to(dtype) for _ in range(2))
    before = weights_fingerprint(_module(embed_tokens=embed, lm_head=head))
    swap = [1, 0] + list(range(2, 64))
    assert weights_fingerprint(_module(embed_tokens=embed[swap], lm_head=head[swap])) != before
    words = torch.arange(1 << 12, dtype=torch.int64)
    bumped = words.clone()
    bumped[3] += 1 << 20
    bumped[3 + 512] -= 1 << 20  # the same lane, the same sum of words
    assert bumped.sum() == words.sum()
    assert weights_fingerprint(_module(w=bumped)) != weights_fingerprint(_module(w=words))
    assert weights_fingerprint(_module(embed_tokens=embed.clone(), lm_head=head.clone())) == before


def test_fingerprints_of_the_first_scheme_are_not_compared():
    from oppo.fingerprint import changed_models

    now = {"reference": {"path": "r", "fingerprint": "w2:ab"}, "tokenizer": {"path": "p", "fingerprint": "cd"}}
    old = {"reference": {"path": "r", "fingerprint": "9f"}, "tokenizer": {"path": "p", "fingerprint": "ce"}}
    assert changed_models(old, now) == [("tokenizer", "p", "p")]  # the weights' schemes differ: unchecked
    assert changed_models({**old, "reference": {"path": "r", "fingerprint": "w2:ac"}}, now)[0][0] == "reference"


def test_changed_prompt_file_or_chat_template_is_refused(tiny_models, tmp_path, capsys):
    """A resume reads the prompt set and the chat template again: a line inserted at the top of the
    JSONL (every record after it moves: a carried sequence would be scored with another record's
    column) or another template is refused, naming it, before any state is restored."""
    import json as _json

    models = {"policy": tmp_path / "policy", "reward": tiny_models["reward"], "reference": tmp_path / "policy"}
    shutil.copytree(tiny_models["policy"], models["policy"])
    cfg_path = models["policy"] / "tokenizer_config.json"
    conf = _json.loads(cfg_path.read_text())
    conf["chat_template"] = "{% for m in messages %}we . {{ m['content'] }} .{% endfor %} it"
    cfg_path.write_text(_json.dumps(conf))
    prompts = tmp_path / "prompts.jsonl"
    lines = [_json.dumps({"prompt": [{"role": "user", "content": t}], "answer": i})
             for i, t in enumerate(["the film was", "a day", "i liked the book", "the story is"])]
    prompts.write_text("\n".join(lines) + "\n")
    out = tmp_path / "run"
    run(models, prompts, out, 1)
    saved = json.loads((latest_checkpoint(out) / MODELS_FILE).read_text())
    assert {"prompts", "chat_template"} <= set(saved), "conversations went through the template: both recorded"
    before = snapshot(out)

    prompts.write_text(_json.dumps({"prompt": [{"role": "user", "content": "a great"}], "answer": 9}) + "\n"
                       + "\n".join(lines) + "\n")
    capsys.readouterr()
    assert main(["train", "--resume", "auto", *settings(models, prompts, out, 2)]) == 2
    err = error_line(capsys)
    assert err.startswith("oppo: error: cannot resume from") and "Traceback" not in err
    assert f"the prompt set at {prompts} differs" in err and "chat template" not in err
    assert "reference model" not in err and "Restore the prompt set" in err
    assert f"policy.path={latest_checkpoint(out) / 'policy'}" in err
    assert snapshot(out) == before, "the refused resume changed the run directory"

    prompts.write_text("\n".join(lines) + "\n")  # the prompts as they were, another template
    conf["chat_template"] = "{% for m in messages %}i . {{ m['content'] }} .{% endfor %} it"
    cfg_path.write_text(_json.dumps(conf))
    with pytest.raises(ModelLoadError, match=f"the chat template of the policy's tokenizer at {models['policy']}"):
        run(models, prompts, out, 2, resume="auto")
    conf["chat_template"] = "{% for m in messages %}we . {{ m['content'] }} .{% endfor %} it"  # restored: resumes
    cfg_path.write_text(_json.dumps(conf))
    run(models, prompts, out, 2, resume="auto")
    assert latest_checkpoint(out).name == "step_000002"
