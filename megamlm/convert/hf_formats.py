"""The transformers classes megamlm converts, one `HFFormat` each: `RobertaForMaskedLM` (and XLM-R's, CamemBERT's) /
`BertForMaskedLM` / `AlbertForMaskedLM` / `ModernBertForMaskedLM` / `ElectraForPreTraining` (+ its generator
`ElectraForMaskedLM`) / `DistilBertForMaskedLM` <-> megamlm key tables (full TP=1 tensors; the conversion
itself: convert/hf.py).

One declarative table per format maps each HF key to a megamlm key (`HFFormat.keys`); the only
non-renaming steps are written next to it:
- megatron's fused QKV (per head [q_h; k_h; v_h] rows) <-> HF's separate query / key / value;
- positions: megamlm's table has fairseq's layout (row 2 is the first token's, `POSITION_OFFSET`).
  RoBERTa's table is that layout already; BERT's row 0 is the first token's, so its rows go to
  rows 2... and rows 0-1 (padding's) are zero;
- token types: RoBERTa has a single type whose row is a constant added everywhere (folded into the
  position table); BERT's and ALBERT's two rows are megamlm's `model.token_types` table;
- ALBERT's one shared layer is megamlm's layer 0 (model.share_layers), its `embedding_hidden_mapping_in`
  megamlm's embedding projection (model.embedding_size);
- ModernBERT's `Wqkv` rows are [all heads' q; k; v] (`fused_qkv`); its `Wi` rows are [activation half;
  gate half], megatron's full gated fc1 layout as is (model/tp.py shards it); it has no position table
  (RoPE), no layer-0 attention norm (model.first_layer_norm) and, by default, no biases: keys a model
  does not have are absent on both sides (`_rename`), and a decoder without bias imports as zeros;
- DistilBERT is BERT's encoder without token types, under its own key and config names (`config_names`);
- ELECTRA's discriminator is BERT's encoder (`electra.*`, its `embeddings_project` megamlm's embedding
  projection when embedding_size differs from hidden_size) with the replaced-token head and no MLM head;
  its generator (`ElectraForMaskedLM`, a folder of its own) is megamlm's `generator.*` reading the
  discriminator's embedding (convert/hf_electra.py);
- BERT's / ALBERT's pretraining checkpoints also hold a sentence-pair head (pooler + NSP / SOP classifier):
  it is the model folder's classification head `nsp` / `sop` (`pair_head`), written back as the
  pretraining class (`HFFormat.pretraining`);
- a fine-tuned folder's classification head (`megamlm glue --save`) exports as the format's
  *ForSequenceClassification (`sequence_head`: RoBERTa's classifier.dense/out_proj, BERT's and ALBERT's
  pooler + classifier for the `pooler` head; ModernBERT's head + classifier for `mlm_head`; ELECTRA's
  classifier.dense/out_proj for `dense_gelu`; DistilBERT's pre_classifier + classifier for `dense_relu`),
  and such a class imports as the encoder with that classification head (no MLM head);
- vocabulary rows: roberta-base's ids are fairseq's; XLM-R's SentencePiece, BERT's WordPiece and ALBERT's
  SentencePiece ids are permuted into megamlm's (data/pieces.py: vocab_order; XLM-R's is the identity) by
  the importer / exporter, which hold the vocab.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megamlm.model import names
from megamlm.model.names import weight_and_bias

# RoBERTa and BERT are post-LN: megatron's post-LN slots
POST_LN = {"attention": names.ATTENTION_NORM.replace("{attn_norm}", names.LAYER_NORM_SLOTS["post"]["attn_norm"]),
           "mlp": names.MLP_NORM.replace("{mlp_norm}", names.LAYER_NORM_SLOTS["post"]["mlp_norm"])}
PRE_LN = {"attention": names.ATTENTION_NORM.replace("{attn_norm}", names.LAYER_NORM_SLOTS["pre"]["attn_norm"]),
          "mlp": names.MLP_NORM.replace("{mlp_norm}", names.LAYER_NORM_SLOTS["pre"]["mlp_norm"])}
POSITION_OFFSET = 2
"""megamlm's (fairseq's) position table has max_positions + 2 rows: rows 0-1 unused, padding_idx 1."""


def _body(prefix: str) -> list[tuple[str, str]]:
    """(HF key, megamlm key) of the encoder shared by RobertaModel and BertModel; {i}: the layer."""
    layer = f"{prefix}.encoder.layer.{{i}}"
    return [
        (f"{prefix}.embeddings.word_embeddings.weight", names.WORD_EMBEDDINGS),
        *weight_and_bias(f"{prefix}.embeddings.LayerNorm.{{kind}}", names.EMBEDDING_NORM),
        *weight_and_bias(f"{layer}.attention.output.dense.{{kind}}", names.ATTENTION_OUT),
        *weight_and_bias(f"{layer}.attention.output.LayerNorm.{{kind}}", POST_LN["attention"]),
        *weight_and_bias(f"{layer}.intermediate.dense.{{kind}}", names.FC1),
        *weight_and_bias(f"{layer}.output.dense.{{kind}}", names.FC2),
        *weight_and_bias(f"{layer}.output.LayerNorm.{{kind}}", POST_LN["mlp"]),
    ]


@dataclass(frozen=True)
class HFFormat:
    """One transformers masked-LM class in megamlm terms."""

    architecture: str
    """The class name config.json's `architectures` gives."""
    prefix: str
    """The encoder's attribute (roberta, bert)."""
    keys: list[tuple[str, str]]
    """(HF key, megamlm key) pairs that are pure renames; {i}: the layer, {kind}: weight | bias."""
    qkv: str
    """The separate query / key / value of layer {i}: {part} query | key | value."""
    head: str
    """The MLM head's prefix; its decoder (`{head}.decoder`) is tied to the word embeddings."""
    position_rows_dropped: int
    """megamlm position rows before HF's row 0 (RoBERTa 0: same layout; BERT 2)."""
    fixed: dict
    """config.json values the format must have for megamlm to compute the same function."""
    config: tuple[tuple[str, str], ...] = ()
    """(config attribute, ModelConfig field) pairs beyond HF_CONFIG."""
    variant: dict = field(default_factory=dict)
    """ModelConfig values the format always has (beyond the variant file's)."""
    fused_qkv: bool = False
    """`qkv` is one tensor of rows [q; k; v] (ModernBERT's Wqkv), not three {part}s."""
    position_table: bool = True
    """Position and token-type tables in BERT's layout (ModernBERT: neither)."""
    mlm_head: bool = True
    """The format has an MLM head whose decoder is tied to the word embeddings (ELECTRA's discriminator: none)."""
    objective: str = "mlm"
    """The megamlm objective whose model the format is (objective.name)."""
    pair_head: tuple[str, str, str] | None = None
    """(objective, pooler, classifier) of a pretraining checkpoint's sentence-pair head ({kind}: weight |
    bias): BERT's pooler + next-sentence classifier, ALBERT's + sentence-order classifier; None: none."""
    sequence_head: tuple[str, tuple[tuple[str, str], ...]] | None = None
    """(model.classifier, (our head's parameter, the *ForSequenceClassification key) pairs, {kind}: weight |
    bias) of the format's sequence classifier, the same function as that megamlm head; None: none that is."""
    tied_decoder: str | None = None
    """The tied decoder's key ({kind}) where it is not `{head}.decoder.{kind}` (ELECTRA's generator_lm_head)."""
    qkv_parts: tuple[str, str, str] = ("query", "key", "value")
    """`qkv`'s {part} names of the query, key and value."""
    token_type_table: bool = True
    """`{prefix}.embeddings.token_type_embeddings` exists (DistilBERT: no token types at all)."""
    config_names: tuple[tuple[str, str | None], ...] = ()
    """(HF_CONFIG's / hidden_act's / type_vocab_size's name, this format's config.json name, None where the
    model code fixes the value) where the format names a setting otherwise (DistilBERT's dim, n_layers, ...)."""

    @property
    def positions(self) -> str:
        return f"{self.prefix}.embeddings.position_embeddings.weight"

    @property
    def token_types(self) -> str:
        return f"{self.prefix}.embeddings.token_type_embeddings.weight"

    @property
    def word_embeddings(self) -> str:
        return next(theirs for theirs, ours in self.keys if ours == names.WORD_EMBEDDINGS)

    @property
    def decoder(self) -> str:
        if self.tied_decoder:
            return self.tied_decoder
        return f"{self.head}.decoder.{{kind}}" if self.head else "decoder.{kind}"

    @property
    def pretraining(self) -> str:
        """The pretraining class (masked LM + the sentence-pair head) of a format with a pair head."""
        return self.architecture.replace("ForMaskedLM", "ForPreTraining")

    @property
    def sequence_classification(self) -> str:
        """The sequence-classification class of a format with a `sequence_head`."""
        return self.architecture.split("For")[0] + "ForSequenceClassification"

    @property
    def base_model(self) -> str:
        """The bare encoder's class (BertModel, ...): no head; its state dict's keys lack `prefix`."""
        return self.architecture.split("For")[0] + "Model"

    @property
    def config_class(self) -> str:
        """transformers' config class of the format (RobertaConfig, ...)."""
        return self.architecture.split("For")[0] + "Config"

    def build(self, values: dict, pretraining: bool = False, classifier: bool = False, base: bool = False,
              **config_options):
        """The transformers model of this class (`pretraining`: its pretraining class; `classifier`: its
        sequence-classification class; `base`: its bare encoder) for config.json `values` (hf_config_values),
        freshly initialized; `config_options` go to its config class (e.g. attn_implementation)."""
        import transformers

        config_class = getattr(transformers, self.config_class)
        name = (self.base_model if base else self.sequence_classification if classifier
                else self.pretraining if pretraining else self.architecture)
        return getattr(transformers, name)(config_class(**values, **config_options))


ALBERT_LAYER = "albert.encoder.albert_layer_groups.0.albert_layers.{i}"
"""ALBERT's one layer group holding one layer ({i} = 0, megamlm's shared layer 0)."""

ROBERTA = HFFormat(
    "RobertaForMaskedLM", "roberta",
    _body("roberta") + [*weight_and_bias("lm_head.dense.{kind}", names.LM_HEAD_DENSE),
                        *weight_and_bias("lm_head.layer_norm.{kind}", names.LM_HEAD_NORM),
                        ("lm_head.bias", names.LM_HEAD_BIAS)],
    qkv="roberta.encoder.layer.{i}.attention.self.{part}.{kind}", head="lm_head", position_rows_dropped=0,
    fixed={"type_vocab_size": 1, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2, "tie_word_embeddings": True},
    sequence_head=("pooler", (("dense.{kind}", "classifier.dense.{kind}"),
                              ("out_proj.{kind}", "classifier.out_proj.{kind}"))))
XLM_ROBERTA = dataclasses.replace(ROBERTA, architecture="XLMRobertaForMaskedLM")
"""XLM-R: RoBERTa's model (the same keys, `roberta.*`) with a SentencePiece tokenizer.json whose ids are
fairseq's order already (<s> <pad> </s> <unk> ... <mask>)."""
CAMEMBERT = dataclasses.replace(ROBERTA, architecture="CamembertForMaskedLM", fixed={
    key: value for key, value in ROBERTA.fixed.items() if key not in ("bos_token_id", "eos_token_id")})
"""CamemBERT: RoBERTa's model with a SentencePiece tokenizer.json whose <s> and </s> are ids 5 and 6 (0 and 2
are unused `<s>NOTUSED` / `</s>NOTUSED`); megamlm's vocabulary order moves them to 0 and 2."""
ROBERTAS = (ROBERTA, XLM_ROBERTA, CAMEMBERT)
"""The formats with RoBERTa's model: one token type, folded into the positions."""
BERT = HFFormat(
    "BertForMaskedLM", "bert",
    _body("bert") + [*weight_and_bias("cls.predictions.transform.dense.{kind}", names.LM_HEAD_DENSE),
                     *weight_and_bias("cls.predictions.transform.LayerNorm.{kind}", names.LM_HEAD_NORM),
                     ("cls.predictions.bias", names.LM_HEAD_BIAS)],
    qkv="bert.encoder.layer.{i}.attention.self.{part}.{kind}", head="cls.predictions",
    position_rows_dropped=POSITION_OFFSET, fixed={"tie_word_embeddings": True},
    pair_head=("nsp", "bert.pooler.dense.{kind}", "cls.seq_relationship.{kind}"),
    sequence_head=("pooler", (("dense.{kind}", "bert.pooler.dense.{kind}"), ("out_proj.{kind}", "classifier.{kind}"))))
ALBERT = HFFormat(
    "AlbertForMaskedLM", "albert",
    [("albert.embeddings.word_embeddings.weight", names.WORD_EMBEDDINGS),
     *weight_and_bias("albert.embeddings.LayerNorm.{kind}", names.EMBEDDING_NORM),
     *weight_and_bias("albert.encoder.embedding_hidden_mapping_in.{kind}", names.EMBEDDING_PROJECTION),
     *weight_and_bias(f"{ALBERT_LAYER}.attention.dense.{{kind}}", names.ATTENTION_OUT),
     *weight_and_bias(f"{ALBERT_LAYER}.attention.LayerNorm.{{kind}}", POST_LN["attention"]),
     *weight_and_bias(f"{ALBERT_LAYER}.ffn.{{kind}}", names.FC1),
     *weight_and_bias(f"{ALBERT_LAYER}.ffn_output.{{kind}}", names.FC2),
     *weight_and_bias(f"{ALBERT_LAYER}.full_layer_layer_norm.{{kind}}", POST_LN["mlp"]),
     *weight_and_bias("predictions.dense.{kind}", names.LM_HEAD_DENSE),
     *weight_and_bias("predictions.LayerNorm.{kind}", names.LM_HEAD_NORM),
     ("predictions.bias", names.LM_HEAD_BIAS)],
    qkv=f"{ALBERT_LAYER}.attention.{{part}}.{{kind}}", head="predictions", position_rows_dropped=POSITION_OFFSET,
    fixed={"num_hidden_groups": 1, "inner_group_num": 1, "tie_word_embeddings": True},
    config=(("embedding_size", "embedding_size"),), variant={"share_layers": True},
    pair_head=("sop", "albert.pooler.{kind}", "sop_classifier.classifier.{kind}"),
    sequence_head=("pooler", (("dense.{kind}", "albert.pooler.{kind}"), ("out_proj.{kind}", "classifier.{kind}"))))
MODERNBERT_LAYER = "model.layers.{i}"
MODERNBERT = HFFormat(
    "ModernBertForMaskedLM", "model",
    [("model.embeddings.tok_embeddings.weight", names.WORD_EMBEDDINGS),
     *weight_and_bias("model.embeddings.norm.{kind}", names.EMBEDDING_NORM),
     *weight_and_bias(f"{MODERNBERT_LAYER}.attn_norm.{{kind}}", PRE_LN["attention"]),  # none in layer 0
     *weight_and_bias(f"{MODERNBERT_LAYER}.attn.Wo.{{kind}}", names.ATTENTION_OUT),
     *weight_and_bias(f"{MODERNBERT_LAYER}.mlp_norm.{{kind}}", PRE_LN["mlp"]),
     *weight_and_bias(f"{MODERNBERT_LAYER}.mlp.Wi.{{kind}}", names.FC1),
     *weight_and_bias(f"{MODERNBERT_LAYER}.mlp.Wo.{{kind}}", names.FC2),
     *weight_and_bias("model.final_norm.{kind}", names.FINAL_NORM),
     *weight_and_bias("head.dense.{kind}", names.LM_HEAD_DENSE),
     *weight_and_bias("head.norm.{kind}", names.LM_HEAD_NORM),
     ("decoder.bias", names.LM_HEAD_BIAS)],
    qkv=f"{MODERNBERT_LAYER}.attn.Wqkv.{{kind}}", head="", position_rows_dropped=0,
    fixed={"tie_word_embeddings": True}, fused_qkv=True, position_table=False,
    sequence_head=("mlm_head", (("dense.{kind}", "head.dense.{kind}"), ("layernorm.{kind}", "head.norm.{kind}"),
                                ("out_proj.{kind}", "classifier.{kind}"))))
ELECTRA = HFFormat(
    "ElectraForPreTraining", "electra",
    _body("electra") + [*weight_and_bias("electra.embeddings_project.{kind}", names.EMBEDDING_PROJECTION),
                        *weight_and_bias("discriminator_predictions.dense.{kind}", names.DISCRIMINATOR_DENSE),
                        *weight_and_bias("discriminator_predictions.dense_prediction.{kind}",
                                         names.DISCRIMINATOR_PREDICTION)],
    qkv="electra.encoder.layer.{i}.attention.self.{part}.{kind}", head="", position_rows_dropped=POSITION_OFFSET,
    fixed={}, config=(("embedding_size", "embedding_size"),), variant={"classifier": "linear"}, mlm_head=False,
    objective="electra", sequence_head=("dense_gelu", (("dense.{kind}", "classifier.dense.{kind}"),
                                                       ("out_proj.{kind}", "classifier.out_proj.{kind}"))))
ELECTRA_GENERATOR = HFFormat(
    "ElectraForMaskedLM", "electra",
    _body("electra") + [*weight_and_bias("electra.embeddings_project.{kind}", names.EMBEDDING_PROJECTION),
                        *weight_and_bias("generator_predictions.dense.{kind}", names.LM_HEAD_DENSE),
                        *weight_and_bias("generator_predictions.LayerNorm.{kind}", names.LM_HEAD_NORM),
                        ("generator_lm_head.bias", names.LM_HEAD_BIAS)],
    qkv=ELECTRA.qkv, head="generator_predictions", position_rows_dropped=POSITION_OFFSET, fixed={},
    config=ELECTRA.config, tied_decoder="generator_lm_head.{kind}", objective="electra")
"""ELECTRA's generator (`megamlm convert --from hf --generator`): BERT's encoder reading the discriminator's
embedding module (the generator's `electra.embeddings.*` are the same tensors), its own projection and an MLM
head whose dense maps to the embedding width (ALBERT's), tied to the word embeddings; megamlm's `generator.*`."""
DISTILBERT_LAYER = "distilbert.transformer.layer.{i}"
DISTILBERT = HFFormat(
    "DistilBertForMaskedLM", "distilbert",
    [("distilbert.embeddings.word_embeddings.weight", names.WORD_EMBEDDINGS),
     *weight_and_bias("distilbert.embeddings.LayerNorm.{kind}", names.EMBEDDING_NORM),
     *weight_and_bias(f"{DISTILBERT_LAYER}.attention.out_lin.{{kind}}", names.ATTENTION_OUT),
     *weight_and_bias(f"{DISTILBERT_LAYER}.sa_layer_norm.{{kind}}", POST_LN["attention"]),
     *weight_and_bias(f"{DISTILBERT_LAYER}.ffn.lin1.{{kind}}", names.FC1),
     *weight_and_bias(f"{DISTILBERT_LAYER}.ffn.lin2.{{kind}}", names.FC2),
     *weight_and_bias(f"{DISTILBERT_LAYER}.output_layer_norm.{{kind}}", POST_LN["mlp"]),
     *weight_and_bias("vocab_transform.{kind}", names.LM_HEAD_DENSE),
     *weight_and_bias("vocab_layer_norm.{kind}", names.LM_HEAD_NORM),
     ("vocab_projector.bias", names.LM_HEAD_BIAS)],
    qkv=f"{DISTILBERT_LAYER}.attention.{{part}}_lin.{{kind}}", head="", position_rows_dropped=POSITION_OFFSET,
    fixed={}, tied_decoder="vocab_projector.{kind}",
    qkv_parts=("q", "k", "v"), token_type_table=False, variant={"token_types": 0, "layernorm_epsilon": 1e-12},
    sequence_head=("dense_relu", (("dense.{kind}", "pre_classifier.{kind}"), ("out_proj.{kind}", "classifier.{kind}"))),
    config_names=(("hidden_size", "dim"), ("num_hidden_layers", "n_layers"), ("num_attention_heads", "n_heads"),
                  ("intermediate_size", "hidden_dim"), ("hidden_dropout_prob", "dropout"),
                  ("attention_probs_dropout_prob", "attention_dropout"), ("hidden_act", "activation"),
                  ("layer_norm_eps", None), ("type_vocab_size", None)))
"""DistilBERT: BERT's post-LN encoder without token types (its LayerNorms' eps fixed at 1e-12), its own key and
config names, BERT's WordPiece vocabulary and MLM head. (A sinusoidal position table is stored as weights: it
imports as a learned table.)"""
HF_FORMATS = {f.architecture: f for f in (ROBERTA, BERT, ALBERT, MODERNBERT, ELECTRA, XLM_ROBERTA, DISTILBERT,
                                          CAMEMBERT)}
TOKENIZER_FORMATS = {"XLMRobertaTokenizer": XLM_ROBERTA, "CamembertTokenizer": CAMEMBERT}
"""RoBERTa-shaped exports go out as the class their tokenizer's class names (XLM-R's, CamemBERT's)."""
BASE_MODELS = {f.base_model: f for f in HF_FORMATS.values() if f.mlm_head}
"""The bare encoders `--from hf` reads (RobertaModel, BertModel, ...: sentence-embedding models): the encoder,
no head."""
SEQUENCE_CLASSIFIERS = {f.sequence_classification: f for f in HF_FORMATS.values() if f.sequence_head}
"""The *ForSequenceClassification classes `--from hf` reads: the encoder and its classification head, no
masked-LM head."""
PRETRAINING = {f.pretraining: f for f in (BERT, ALBERT)}
"""The pretraining classes, read as their masked-LM class plus the sentence-pair head (Hub folders of
bert-base / albert-base name the masked-LM class but hold the pretraining weights)."""
