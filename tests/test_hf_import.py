"""`megamlm convert --from hf`: a RobertaForMaskedLM folder (random, non-default shape, saved locally)
-> megamlm at TP=1/2/3 with transformers' logits, back to Hugging Face, bad folders refused in one
line; and continued pretraining from it end to end (issue 18, RoBERTa part)."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from megamlm.cli import main as cli
from megamlm.convert.pipeline import convert, read_megamlm
from megamlm.data.tokenizer import Tokenizer
from tests.multiproc import run_on_ranks
from tests.faults_common import one_line
from tests.test_train import config, tiny_shards

QUIET = {"log": lambda *a: None, "tolerance": 1e-5}


def save_roberta(folder: Path, heads: int = 3, seed: int = 0, architecture: str = "Roberta",
                 vocab_size: int = 50265) -> Path:
    """A random RobertaForMaskedLM (`architecture`: XLMRoberta for XLM-R's class) with every weight nonzero
    (LayerNorms, biases, the token-type row)."""
    import transformers

    torch.manual_seed(seed)
    cfg = getattr(transformers, f"{architecture}Config")(
        vocab_size=vocab_size, hidden_size=48, num_hidden_layers=2, num_attention_heads=heads, intermediate_size=96,
        max_position_embeddings=66, type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        layer_norm_eps=1e-5)
    model = getattr(transformers, f"{architecture}ForMaskedLM")(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(folder)
    return folder


def hf_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import RobertaForMaskedLM

    model = RobertaForMaskedLM.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(input_ids=tokens, attention_mask=tokens.ne(1).long()).logits


@pytest.mark.parametrize("heads,tp", [(3, 1), (3, 3), (6, 2)])
def test_roberta_folder_converts_both_ways_with_transformers_logits(world, tmp_path, heads, tp):
    from megamlm.convert.parity import probe_tokens
    from megamlm.convert.pipeline import read_megamlm

    source = save_roberta(tmp_path / "hf", heads)
    report = convert("hf", "megamlm", source, tmp_path / "megamlm", tp=tp, **QUIET)
    assert report["max_diff"]["hf source"] < 1e-5  # vs transformers' forward of the folder (50,265 logits)
    model = read_megamlm(tmp_path / "megamlm")
    assert model.cfg.parallel.tensor_parallel == tp and model.cfg.model.num_attention_heads == heads
    back = convert("megamlm", "hf", tmp_path / "megamlm", tmp_path / "back", **QUIET)
    assert back["max_diff"]["transformers RobertaForMaskedLM"] < 1e-5
    tokens = probe_tokens(model.cfg, seed=3)
    real = tokens.ne(1)
    diff = (hf_logits(source, tokens) - hf_logits(tmp_path / "back", tokens))[real].abs().max().item()
    assert diff < 1e-5  # the round trip computes the source's function (token type folded into positions)


def test_hugging_face_roberta_ids_are_fairseq_ids(world, tmp_path):
    """RoBERTa's vocab.json is fairseq's dictionary order: the exported tokenizer (transformers'
    RobertaTokenizer) gives megamlm's ids, specials included."""
    from transformers import AutoTokenizer

    convert("hf", "megamlm", save_roberta(tmp_path / "hf"), tmp_path / "megamlm", **QUIET)
    convert("megamlm", "hf", tmp_path / "megamlm", tmp_path / "back", **QUIET)
    theirs = AutoTokenizer.from_pretrained(tmp_path / "back")
    ours = Tokenizer.gpt2()
    text = "Masked language models: ALiBi, CLAP heads and 2,048 tokens — naïve café."
    assert theirs(text, add_special_tokens=False)["input_ids"] == ours.encode(text).tolist()
    assert [theirs.bos_token_id, theirs.pad_token_id, theirs.eos_token_id, theirs.unk_token_id,
            theirs.mask_token_id] == [0, 1, 2, 3, 50264]


def test_bad_hugging_face_folders_are_one_line_and_write_nothing(world, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    good = save_roberta(tmp_path / "good")
    cases = {}
    other = shutil.copytree(good, tmp_path / "other")
    values = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**values, "architectures": ["ElectraForMaskedLM"]}))
    cases["other"] = ("architecture ElectraForMaskedLM is not supported; --from hf reads RobertaForMaskedLM, "
                      "BertForMaskedLM")
    empty = shutil.copytree(good, tmp_path / "empty")
    (empty / "model.safetensors").unlink()
    cases["empty"] = "no weights (model.safetensors or pytorch_model.bin)"
    missing = shutil.copytree(good, tmp_path / "missing")
    state = load_file(missing / "model.safetensors")
    del state["roberta.encoder.layer.1.output.dense.weight"]
    save_file(state, missing / "model.safetensors")
    cases["missing"] = "missing roberta.encoder.layer.1.output.dense.weight for the shape config.json gives"
    shape = shutil.copytree(good, tmp_path / "shape")
    (shape / "config.json").write_text(json.dumps({**values, "intermediate_size": 64}))
    cases["shape"] = ("roberta.encoder.layer.0.intermediate.dense.weight has shape (96, 48), config.json "
                      "gives (64, 48)")
    typed = shutil.copytree(good, tmp_path / "typed")
    (typed / "config.json").write_text(json.dumps({**values, "num_attention_heads": "3"}))
    cases["typed"] = "transformers' RobertaConfig refuses it: TypeError: Field 'num_attention_heads'"  # its words
    assert_refused_in_one_line(tmp_path, cases, capsys)


def test_keys_config_json_leaves_out_take_transformers_defaults(world, tmp_path):
    """transformers fills a key config.json leaves out with its config class's default; so does the import:
    the folder with every default-valued key removed (vocab_size and the special ids among them) converts to
    the same model, with transformers' logits."""
    from transformers import RobertaConfig

    source = save_roberta(tmp_path / "hf")
    sparse = shutil.copytree(source, tmp_path / "sparse")
    values, defaults = json.loads((sparse / "config.json").read_text()), RobertaConfig().to_dict()
    kept = {key: value for key, value in values.items() if key not in defaults or defaults[key] != value
            or key == "architectures"}
    assert {"vocab_size", "pad_token_id", "hidden_act"} <= values.keys() - kept.keys()
    (sparse / "config.json").write_text(json.dumps(kept))
    report = convert("hf", "megamlm", sparse, tmp_path / "from-sparse", **QUIET)
    assert report["max_diff"]["hf source"] < 1e-5
    full = read_megamlm(convert("hf", "megamlm", source, tmp_path / "from-full", **QUIET)["out"])
    ours = read_megamlm(tmp_path / "from-sparse")
    assert ours.cfg.model == full.cfg.model
    assert ours.full.keys() == full.full.keys() and all(torch.equal(v, full.full[k]) for k, v in ours.full.items())


def test_a_sharded_checkpoint_imports_through_its_index(world, tmp_path, capsys):
    """transformers' shards above max_shard_size (`model.safetensors.index.json` + its files): read whole,
    the same logits; a shard file missing or short of its tensors is refused in one line."""
    from transformers import RobertaForMaskedLM

    source = save_roberta(tmp_path / "hf")
    RobertaForMaskedLM.from_pretrained(source).save_pretrained(tmp_path / "sharded", max_shard_size="1MB")
    name = "model.safetensors"
    index = json.loads((tmp_path / f"sharded/{name}.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2 and not (tmp_path / "sharded" / name).exists()
    report = convert("hf", "megamlm", tmp_path / "sharded", tmp_path / "megamlm", **QUIET)
    assert report["max_diff"]["hf source"] < 1e-5
    whole = read_megamlm(convert("hf", "megamlm", source, tmp_path / "whole", **QUIET)["out"]).full
    assert all(torch.equal(value, whole[key]) for key, value in read_megamlm(tmp_path / "megamlm").full.items())
    gone = shutil.copytree(tmp_path / "sharded", tmp_path / "gone")
    (gone / files[1]).unlink()
    short = shutil.copytree(tmp_path / "sharded", tmp_path / "short")
    moved = next(key for key, file in index["weight_map"].items() if file == files[0])
    index["weight_map"][moved] = files[1]  # the index places a tensor in a file that lacks it
    (short / f"{name}.index.json").write_text(json.dumps(index))
    assert_refused_in_one_line(tmp_path, {"gone": f"names the shard {files[1]}, which",
                                          "short": f"{files[1]}: lacks {moved}, which {name}.index.json places"},
                               capsys)


def assert_refused_in_one_line(tmp_path: Path, cases: dict[str, str], capsys) -> None:
    """`convert --from hf` of each folder tmp_path/<name> exits 2 with one line holding its expected
    text, and writes nothing."""
    for name, expected in cases.items():
        capsys.readouterr()
        out = tmp_path / f"{name}-out"
        assert cli(["convert", "--from", "hf", "--to", "megamlm", str(tmp_path / name), str(out)]) == 2
        line = one_line(capsys.readouterr().err)
        assert line.startswith("megamlm: convert: ") and expected in line, (name, line)
        assert not out.exists()


# ---- continued pretraining ------------------------------------------------------------------------

def _first_batch_and_train(cfg):
    """The first micro-batch the run trains on, and the run's losses."""
    from megamlm.objectives import get_objective
    from megamlm.parallel import init_distributed
    from megamlm.train.checkpoint import TrainState
    from megamlm.train.loop import train
    from megamlm.train.run_data import prepare_data, train_stream

    ctx = init_distributed(cfg.parallel)
    data = prepare_data(cfg, ctx, get_objective(cfg))
    batch = next(iter(train_stream(cfg, ctx, data, TrainState(data_seed=cfg.train.seed))))
    return batch, train(cfg)["losses"]


def continue_pretraining(source: Path, tmp_path: Path):
    """Convert the (RoBERTa-shaped) transformers folder `source` to tmp_path/start and train 3 updates from it
    (train.init_from) in tmp_path/run on tiny shards: (config, the first micro-batch, the losses)."""
    convert("hf", "megamlm", source, tmp_path / "start", **QUIET)
    shards = tiny_shards(_Factory(tmp_path), "cp")
    cfg = config(shards, tmp_path / "run", f"train.init_from={tmp_path / 'start'}", "model.hidden_size=48",
                 "model.num_attention_heads=3", "model.ffn_hidden_size=96", "model.hidden_dropout=0",
                 "model.attention_dropout=0", "train.steps=3")
    return (cfg, *run_on_ranks(_first_batch_and_train, 1, cfg)[0])


@pytest.mark.slow
def test_continued_pretraining_from_a_hugging_face_roberta(world, tmp_path, capsys):
    from transformers import pipeline

    source = save_roberta(tmp_path / "hf", seed=1)
    _, batch, losses = continue_pretraining(source, tmp_path)
    logits = hf_logits(source, batch.inputs).reshape(-1, 50265)[batch.target_index]
    hf_loss = torch.nn.functional.cross_entropy(logits, batch.targets).item()
    assert abs(losses[0] - hf_loss) < 1e-5, (losses[0], hf_loss)  # the first update starts from HF's model
    assert losses[-1] < losses[0]
    convert("megamlm", "hf", tmp_path / "run/final", tmp_path / "continued", **QUIET)
    fill = pipeline("fill-mask", model=str(tmp_path / "continued"), top_k=3)
    results = fill("The capital of France is <mask>.")
    assert len(results) == 3 and all(r["sequence"].startswith("The capital of France is") for r in results)


class _Factory:
    """tmp_path_factory's two methods over one folder (tiny_shards takes a factory)."""

    def __init__(self, root: Path):
        self.root = root

    def mktemp(self, name: str) -> Path:
        (self.root / name).mkdir()
        return self.root / name

    def getbasetemp(self) -> Path:
        return self.root
