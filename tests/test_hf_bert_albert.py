"""BERT and ALBERT: `convert --from hf` reads a BertForMaskedLM / AlbertForMaskedLM folder (random,
non-default shape: odd head counts, E != H, a vocabulary not divisible by the TP degree, its own
WordPiece / SentencePiece vocabulary, saved locally) with transformers' logits at TP=1/2, writes it
back in the same class, and the tokenizers, token types and GLUE pairs are transformers' (issue 18)."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from megamlm.cli import main as cli
from megamlm.config import load_config
from megamlm.data.shards import BuildOptions, build_shards
from megamlm.convert.pipeline import convert, read_megamlm
from megamlm.data.pieces import WordPieceTokenizer
from megamlm.data.tokenizer import Tokenizer
from megamlm.glue.finetune import encode
from megamlm.glue.tasks import Example
from megamlm.model.embedding import token_types
from megamlm.model.folder import read_model_folder, write_model_folder
from megamlm.model.reshard import full_state_dict
from megamlm.objectives import MaskedLM
from tests.multiproc import run_on_ranks
from tests.faults_common import one_line
from tests.test_hf_import import _first_batch_and_train, assert_refused_in_one_line
from tests.test_train import ROOT, logged
from tests.variants import variant_config

QUIET = {"log": lambda *a: None, "tolerance": 1e-5}
WORDS = ("the a of and to in is was he she it for on with as his her by at from that this which an be "
         "paris city river bank model language mask head token train test good bad fox dog run jump").split()
# 301 pieces, BERT's specials at BERT's rows (not megamlm's): [PAD] 0, [UNK] 3, [CLS] 4, [SEP] 5, [MASK] 6
VOCAB = (["[PAD]", "[unused0]", "[unused1]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ",", "!", "?"]
         + list("abcdefghijklmnopqrstuvwxyz") + [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"] + list(WORDS)
         + [f"##{w}" for w in WORDS])
VOCAB += [f"w{i}" for i in range(301 - len(VOCAB))]


def save_bert(folder: Path, heads: int = 3, seed: int = 0, pretraining: bool = False) -> Path:
    """A random BertForMaskedLM (every weight nonzero, both token types) and its BertTokenizer;
    `pretraining`: a BertForPreTraining (+ the pooler and the next-sentence classifier)."""
    import transformers
    from transformers import BertConfig

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=len(VOCAB), hidden_size=48, num_hidden_layers=2, num_attention_heads=heads,
                     intermediate_size=96, max_position_embeddings=40, type_vocab_size=2, layer_norm_eps=1e-12)
    return save_with_wordpiece(getattr(transformers, "BertForPreTraining" if pretraining else "BertForMaskedLM")(cfg),
                               folder)


def save_with_wordpiece(model, folder: Path) -> Path:
    """`model` with every weight drawn from N(0, 0.2) (nonzero biases and norms too), saved with VOCAB as
    its BertTokenizer's vocab.txt."""
    from transformers import BertTokenizer

    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(folder)
    (folder / "vocab.txt").write_text("".join(f"{piece}\n" for piece in VOCAB))
    BertTokenizer(vocab=str(folder / "vocab.txt"), do_lower_case=True).save_pretrained(folder)
    return folder


# 301 SentencePiece pieces with ALBERT's specials at ALBERT's rows: <pad> 0, <unk> 1, [CLS] 2, [SEP] 3, [MASK] 4
ALBERT_VOCAB = list(dict.fromkeys(["<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]", "\u2581"]
                                  + [f"\u2581{w}" for w in WORDS] + list("abcdefghijklmnopqrstuvwxyz.,!?") + WORDS))
ALBERT_VOCAB += [f"\u2581w{i}" for i in range(301 - len(ALBERT_VOCAB))]


def save_albert(folder: Path, heads: int = 3, seed: int = 0, pretraining: bool = False) -> Path:
    """A random AlbertForMaskedLM (E = 24 != H = 48, 3 applications of one layer, gelu_new) and its
    SentencePiece (Unigram) AlbertTokenizer; `pretraining`: an AlbertForPreTraining (+ the pooler and the
    sentence-order classifier)."""
    import transformers
    from transformers import AlbertConfig, AlbertTokenizer

    torch.manual_seed(seed)
    cfg = AlbertConfig(vocab_size=len(ALBERT_VOCAB), embedding_size=24, hidden_size=48, num_hidden_layers=3,
                       num_attention_heads=heads, intermediate_size=96, max_position_embeddings=40,
                       hidden_act="gelu_new", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = getattr(transformers, "AlbertForPreTraining" if pretraining else "AlbertForMaskedLM")(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(folder)
    scores = [(piece, 0.0 if i < 5 else -1.0 - len(piece) * 0.1) for i, piece in enumerate(ALBERT_VOCAB)]
    AlbertTokenizer(vocab=scores).save_pretrained(folder)
    return folder


SAVE = {"BertForMaskedLM": save_bert, "AlbertForMaskedLM": save_albert}


def hf_logits(folder: Path, text_a: str, text_b: str) -> tuple[torch.Tensor, dict]:
    """transformers' own tokenizer and model on a sentence pair (their ids, token types)."""
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    inputs = AutoTokenizer.from_pretrained(folder)(text_a, text_b, return_tensors="pt", return_token_type_ids=True)
    model = AutoModelForMaskedLM.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(**inputs).logits, inputs


@pytest.mark.parametrize("heads,tp", [(3, 1), (6, 2)])
@pytest.mark.parametrize("architecture", ["BertForMaskedLM", "AlbertForMaskedLM"])
def test_folder_converts_both_ways_with_transformers_logits(world, tmp_path, architecture, heads, tp):
    source = SAVE[architecture](tmp_path / "hf", heads)
    report = convert("hf", "megamlm", source, tmp_path / "megamlm", tp=tp, **QUIET)
    assert report["max_diff"]["hf source"] < 1e-5  # transformers' forward, token type 1 included
    model = read_megamlm(tmp_path / "megamlm")
    assert model.cfg.parallel.tensor_parallel == tp and model.cfg.model.token_types == 2
    assert model.cfg.model.vocab_size == 301 and model.cfg.model.layernorm_epsilon == 1e-12
    if architecture == "AlbertForMaskedLM":
        m = model.cfg.model
        assert (m.embedding_size, m.share_layers, m.activation, m.num_layers) == (24, True, "gelu_tanh", 3)
    back = convert("megamlm", "hf", tmp_path / "megamlm", tmp_path / "back", **QUIET)
    assert back["max_diff"][f"transformers {architecture}"] < 1e-5
    assert json.loads((tmp_path / "back/config.json").read_text())["architectures"] == [architecture]
    # the way back is the source: the same vocabulary, the same logits from transformers' own tokenizer
    vocabulary = "vocab.txt" if architecture == "BertForMaskedLM" else "tokenizer.json"
    assert (tmp_path / "back" / vocabulary).read_text() == (source / vocabulary).read_text()
    want, inputs = hf_logits(source, "The fox jumps over a dog.", "Paris is a city.")
    got, _ = hf_logits(tmp_path / "back", "The fox jumps over a dog.", "Paris is a city.")
    assert inputs["token_type_ids"].max() == 1
    assert (got - want).abs().max().item() < 1e-5


def test_wordpiece_ids_token_types_and_glue_pairs_are_berts(world, tmp_path):
    """megamlm's WordPiece ids are BERT's moved to megamlm's places (vocab_order), its token types and
    its GLUE pair encoding are what BertTokenizer gives."""
    from transformers import BertTokenizer

    convert("hf", "megamlm", save_bert(tmp_path / "hf"), tmp_path / "megamlm", **QUIET)
    cfg = read_megamlm(tmp_path / "megamlm").cfg
    ours = Tokenizer.load(cfg.data.tokenizer)
    theirs = BertTokenizer.from_pretrained(tmp_path / "hf")
    assert [VOCAB[i] for i in ours.vocab_order[:4]] == ["[CLS]", "[PAD]", "[SEP]", "[UNK]"]
    assert VOCAB[ours.vocab_order[ours.dictionary.mask_id]] == "[MASK]"
    a, b = "The Fox, jumps over the dog!", "Paris is a river bank."
    assert ours.vocab_order[ours.encode(a)].tolist() == theirs(a, add_special_tokens=False)["input_ids"]
    assert ours.decode(ours.encode(a)) == theirs.decode(theirs(a, add_special_tokens=False)["input_ids"])
    pair = encode([Example(texts=(a, b), label=0)], ours, max_length=64)[0]
    want = theirs(a, b)
    assert ours.vocab_order[pair].tolist() == want["input_ids"]  # [CLS] A [SEP] B [SEP]
    types = token_types(torch.tensor([pair]), cfg.model)[0]
    assert types.tolist() == want["token_type_ids"]
    # ordinary ids (random replacement) leave out every bracketed special, [unused*] included
    assert not {VOCAB[i] for i in ours.vocab_order[ours.dictionary.ordinary_ids()]} & {
        "[PAD]", "[unused0]", "[unused1]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"}


def test_sentencepiece_ids_and_glue_pairs_are_alberts(world, tmp_path):
    from transformers import AlbertTokenizer

    convert("hf", "megamlm", save_albert(tmp_path / "hf"), tmp_path / "megamlm", **QUIET)
    cfg = read_megamlm(tmp_path / "megamlm").cfg
    ours = Tokenizer.load(cfg.data.tokenizer)
    theirs = AlbertTokenizer.from_pretrained(tmp_path / "hf")
    assert [ALBERT_VOCAB[i] for i in ours.vocab_order[:4]] == ["[CLS]", "<pad>", "[SEP]", "<unk>"]
    a, b = "The fox is a city", "paris, the river bank!"
    assert ours.vocab_order[ours.encode(a)].tolist() == theirs(a, add_special_tokens=False)["input_ids"]
    pair = encode([Example(texts=(a, b), label=0)], ours, max_length=64)[0]
    want = theirs(a, b, return_token_type_ids=True)
    assert ours.vocab_order[pair].tolist() == want["input_ids"]  # [CLS] A [SEP] B [SEP]
    assert token_types(torch.tensor([pair]), cfg.model)[0].tolist() == want["token_type_ids"]
    starts = ours.word_starts()[ours.encode(a)]  # SentencePiece's ▁ begins a word
    pieces = [ALBERT_VOCAB[i] for i in theirs(a, add_special_tokens=False)["input_ids"]]
    assert starts.tolist() == [piece.startswith("\u2581") for piece in pieces]


def test_token_types_restart_in_every_packed_sample():
    from megamlm.config import ModelConfig

    model = ModelConfig(token_types=2, vocab_size=50)
    tokens = torch.tensor([[0, 7, 2, 8, 2, 0, 9, 2, 1, 1]])
    segments = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, -1, -1]])
    assert token_types(tokens, model, segments)[0, :8].tolist() == [0, 0, 0, 1, 1, 0, 0, 0]
    assert token_types(tokens, model)[0, :8].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]


def test_train_wordpiece_writes_a_tokenizer_training_reads(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The quick brown fox jumps over the lazy dog.\nUnbelievable things happen in Paris.\n" * 40)
    assert cli(["shards", "train-wordpiece", str(corpus), "--out", str(tmp_path / "wp"), "--vocab-size", "120"]) == 0
    assert "wordpiece.json" in capsys.readouterr().out
    tokenizer = Tokenizer.load(str(tmp_path / "wp"))
    ids = tokenizer.encode("the lazy fox in paris")
    assert tokenizer.decode(ids) == "the lazy fox in paris"
    assert (ids >= 4).all() and len(tokenizer.dictionary) == tokenizer.dictionary.mask_id + 1
    assert np.array_equal(np.sort(tokenizer.vocab_order), np.arange(len(tokenizer.dictionary)))
    assert cli(["shards", "train-wordpiece", str(corpus), "--out", str(tmp_path / "wp")]) == 2
    assert "already holds vocab.txt" in one_line(capsys.readouterr().err)


def test_bad_bert_folders_are_one_line_and_write_nothing(world, tmp_path, capsys):
    good = save_bert(tmp_path / "good")
    cases = {}
    novocab = shutil.copytree(good, tmp_path / "novocab")
    (novocab / "vocab.txt").unlink()
    cases["novocab"] = "no vocab.txt: BertForMaskedLM folders need its WordPiece vocabulary"
    short = shutil.copytree(good, tmp_path / "short")
    (short / "vocab.txt").write_text("".join(f"{p}\n" for p in VOCAB[:-1]))
    cases["short"] = "300 pieces, config.json's vocab_size is 301"
    nomask = shutil.copytree(good, tmp_path / "nomask")
    (nomask / "vocab.txt").write_text("".join(f"{p}\n" for p in VOCAB if p != "[MASK]"))
    cases["nomask"] = "nomask/vocab.txt: no [MASK] piece: not a WordPiece vocabulary"
    albert = save_albert(tmp_path / "albert")
    notokenizer = shutil.copytree(albert, tmp_path / "notokenizer")
    (notokenizer / "tokenizer.json").unlink()
    cases["notokenizer"] = "no tokenizer.json: AlbertForMaskedLM folders need its SentencePiece tokenizer"
    groups = shutil.copytree(albert, tmp_path / "groups")
    values = json.loads((groups / "config.json").read_text())
    (groups / "config.json").write_text(json.dumps({**values, "num_hidden_groups": 3, "hidden_act": "relu"}))
    cases["groups"] = "num_hidden_groups=3 (needs 1); hidden_act='relu' (needs one of gelu, gelu_new"
    assert_refused_in_one_line(tmp_path, cases, capsys)


@pytest.mark.slow
def test_continued_pretraining_of_an_albert_with_sop_and_back_to_transformers(world, tmp_path):
    """An imported ALBERT, shards built with its carried SentencePiece tokenizer, MLM + SOP from
    train.init_from (the pair head starts fresh): the first update's MLM loss is transformers' on the
    same masked batch; the result converts back to AlbertForMaskedLM (the SOP head left out)."""
    from transformers import AlbertForMaskedLM

    source = save_albert(tmp_path / "hf")
    convert("hf", "megamlm", source, tmp_path / "start", **QUIET)
    text = tmp_path / "corpus.txt"
    text.write_text((ROOT / "data/wikitext-103/valid.txt").read_text()[:100_000])
    tokenizer = Tokenizer.load(str(tmp_path / "start/tokenizer"))
    build_shards(BuildOptions([str(text)], str(tmp_path / "shards"), seq_length=40, long_docs="split",
                              valid_fraction=0.1, shard_tokens=8_000), tokenizer, progress=False)
    cfg = load_config([tmp_path / "start/config.yaml"], [
        f"data.shards={tmp_path / 'shards'}", f"train.init_from={tmp_path / 'start'}",
        f"train.run_dir={tmp_path / 'run'}", "objective.name=sop", "train.steps=3", "train.micro_batch_size=4",
        "optim.warmup_steps=1",
        "train.log_interval=1", "train.eval_interval=1000", "train.save_interval=1000"])
    batch, _ = run_on_ranks(_first_batch_and_train, 1, cfg)[0]
    order = tokenizer.vocab_order
    hf = AlbertForMaskedLM.from_pretrained(source, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = hf(input_ids=torch.from_numpy(order)[batch.inputs], attention_mask=batch.inputs.ne(1).long(),
                    token_type_ids=token_types(batch.inputs, cfg.model)).logits[..., torch.from_numpy(order)]
    hf_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 301)[batch.target_index], batch.targets).item()
    mlm = logged(tmp_path / "run", key="mlm_loss")
    assert abs(mlm[1] - hf_loss) < 1e-5, (mlm[1], hf_loss)  # the first update starts from transformers' model
    assert 0.5 < logged(tmp_path / "run", key="sop_loss")[1] < 0.9  # a fresh 2-way head: about ln 2
    report = convert("megamlm", "hf", tmp_path / "run/final", tmp_path / "continued", **QUIET)
    assert report["max_diff"]["transformers AlbertForMaskedLM"] < 1e-5


@pytest.mark.parametrize("parts", [[], ["model.token_types=2", "model.embedding_size=24", "model.share_layers=true",
                                        "model.activation=gelu_tanh", "model.num_layers=3"]],
                         ids=["alibi", "alibi+albert-parts"])
def test_megamlms_own_remote_code_exports_read_back(world, tmp_path, parts):
    """Variants transformers has no class for go out as modeling_megamlm.py (ALiBi; with BERT / ALBERT
    parts and a WordPiece vocabulary written in megamlm's order) and come back bit for bit."""
    if parts:
        WordPieceTokenizer.write(tmp_path / "wordpiece", VOCAB, lowercase=True)
        extra = [*parts, "model.vocab_size=301", f"data.tokenizer={tmp_path / 'wordpiece'}"]
    else:
        extra = ["model.vocab_size=50265", "data.tokenizer=gpt2"]
    cfg = variant_config("alibi", extra)
    write_model_folder(tmp_path / "model", cfg, full_state_dict(MaskedLM(cfg.model, world, seed=5)))
    out = convert("megamlm", "hf", tmp_path / "model", tmp_path / "hf", **QUIET)
    assert out["max_diff"]["transformers MegamlmForMaskedLM (trust_remote_code)"] < 1e-5
    back = convert("hf", "megamlm", tmp_path / "hf", tmp_path / "back", **QUIET)
    assert back["max_diff"]["hf source"] < 1e-5
    original, returned = read_model_folder(tmp_path / "model"), read_model_folder(tmp_path / "back")
    assert returned.cfg.model == original.cfg.model
    assert original.full.keys() == returned.full.keys()
    assert all(torch.equal(original.full[k], returned.full[k]) for k in original.full)
