"""Target patterns (exact, glob, regex, chunk prefix), parameter selection and name squashing."""

from __future__ import annotations

import pytest

from trainmon.config import load_config
from trainmon.config.targets import TargetMatcher, parse_target, squash_name


def test_exact_module_match_is_whole_name():
    m = TargetMatcher(["layers.1"])
    assert m.match_module("layers.1")
    assert not m.match_module("layers.10")
    assert not m.match_module("layers.1.mlp")
    assert not m.match_module("decoder.layers.1")


def test_glob_matches_whole_name_and_crosses_dots():
    m = TargetMatcher(["layers.*.mlp", "emb?dding", "head[0-9]"])
    assert m.match_module("layers.3.mlp")
    assert m.match_module("layers.3.sub.mlp")  # fnmatch's * also matches dots
    assert not m.match_module("layers.3.mlp.fc1")
    assert not m.match_module("x.layers.3.mlp")
    assert m.match_module("embedding")
    assert m.match_module("head7")
    assert not m.match_module("headx")


def test_glob_is_case_sensitive():
    assert not TargetMatcher(["Layers.*"]).match_module("layers.0")


def test_regex_uses_fullmatch():
    m = TargetMatcher([r"re:layers\.(0|2)\.mlp"])
    assert m.match_module("layers.0.mlp")
    assert m.match_module("layers.2.mlp")
    assert not m.match_module("layers.1.mlp")
    assert not m.match_module("layers.0.mlp.fc1")


def test_chunk_prefix_restricts_to_one_chunk():
    m = TargetMatcher(["1:layers.0", "2:re:layers\\.\\d+", "3:*.mlp"])
    assert m.match_module("layers.0", chunk=1)
    assert not m.match_module("layers.0", chunk=0)
    assert m.match_module("layers.7", chunk=2)
    assert not m.match_module("layers.7", chunk=1)
    assert m.match_module("layers.7.mlp", chunk=3)
    assert not m.match_module("layers.7.mlp", chunk=0)


def test_pattern_without_prefix_applies_to_every_chunk():
    m = TargetMatcher(["layers.0"])
    assert all(m.match_module("layers.0", chunk=c) for c in range(4))


def test_colon_without_integer_is_part_of_the_name():
    p = parse_target("a:b")
    assert p.chunk is None and p.body == "a:b"
    assert TargetMatcher(["a:b"]).match_module("a:b")


def test_param_matches_on_dot_boundaries():
    m = TargetMatcher(["layers.1"])
    assert m.match_param("layers.1.weight")
    assert m.match_param("layers.1.mlp.bias")
    assert m.match_param("layers.1")
    assert not m.match_param("layers.10.weight")  # msprobe's startswith would select this
    assert not m.match_param("layers.11.mlp.bias")
    assert not m.match_param("decoder.layers.1.weight")


def test_param_matches_exact_param_name():
    m = TargetMatcher(["layers.0.mlp.fc1.weight"])
    assert m.match_param("layers.0.mlp.fc1.weight")
    assert not m.match_param("layers.0.mlp.fc1.bias")


def test_param_glob_and_regex_match_owning_module():
    m = TargetMatcher(["*.mlp", r"re:embedding\.\w+"])
    assert m.match_param("layers.3.mlp.fc1.weight")
    assert not m.match_param("layers.3.attn.qkv.weight")
    assert m.match_param("embedding.word_embeddings.weight")


def test_param_chunk_prefix():
    m = TargetMatcher(["1:layers.0"])
    assert m.match_param("layers.0.weight", chunk=1)
    assert not m.match_param("layers.0.weight", chunk=0)


def test_empty_targets_select_all_params_but_no_modules():
    m = TargetMatcher()
    assert m.match_param("anything.weight", chunk=3)
    assert not m.match_module("layers.0")


def test_empty_string_target_is_the_root_module():
    m = TargetMatcher([""])
    assert m.match_param("layers.0.weight")
    assert m.match_module("")
    assert not m.match_module("layers.0")


def test_all_modules_flag():
    m = TargetMatcher(["layers.0"], all_modules=True)
    assert m.match_module("whatever")
    assert not m.match_param("layers.1.weight")  # params still follow the targets


def test_from_config_follows_msprobe_semantics():
    assert TargetMatcher.from_config(load_config(xy_distribution=True)).match_module("any")
    assert TargetMatcher.from_config(load_config(all_xy=True, targets=["x"])).match_module("any")
    m = TargetMatcher.from_config(load_config(xy_distribution=True, targets=["x"]))
    assert m.match_module("x") and not m.match_module("y")


def test_invalid_patterns_raise_value_error():
    with pytest.raises(ValueError, match="invalid regular expression"):
        parse_target("re:(")
    with pytest.raises(ValueError, match="invalid regular expression"):
        TargetMatcher(["0:re:[a-"])


def test_parse_target_kinds():
    assert parse_target("layers.0").kind == "exact"
    assert parse_target("layers.*").kind == "glob"
    assert parse_target("re:layers").kind == "regex"
    p = parse_target("12:re:x+")
    assert (p.chunk, p.kind, p.body) == (12, "regex", "x+")


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("module.module.decoder.layers.3.mlp.linear_fc1.weight", "layers.3.mlp.linear_fc1.weight"),
        ("module.language_model.encoder.layers.0.self_attention", "layers.0.self_attention"),
        ("module.module.embedding.word_embeddings.weight", "embedding.word_embeddings.weight"),
        ("bert.embeddings.LayerNorm.weight", "embeddings.LayerNorm.weight"),
        ("model.embed_tokens.weight", "embed_tokens.weight"),
        ("module.module.decoder.final_layernorm.weight", "final_layernorm.weight"),
        ("module.language_model.encoder.final_norm", "final_norm"),
        ("module.module.output_layer.weight", "output_layer.weight"),
        ("model.lm_head.weight", "lm_head.weight"),
        ("layers.0.mlp", "layers.0.mlp"),  # already short: unchanged
        ("transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_attn.weight"),  # no anchor
        ("encoder.sublayers.0.weight", "encoder.sublayers.0.weight"),  # anchors are whole segments
        ("x.my_embedding.weight", "x.my_embedding.weight"),
        ("0:module.module.decoder.layers.1.mlp", "0:layers.1.mlp"),  # chunk prefix kept
        ("", ""),
    ],
)
def test_squash_name(name, expected):
    assert squash_name(name) == expected


def test_squash_name_is_idempotent():
    name = "module.module.decoder.layers.3.mlp.linear_fc1.weight"
    assert squash_name(squash_name(name)) == squash_name(name)


def test_squash_takes_first_anchor_in_the_name():
    assert squash_name("a.embedding.layers.0") == "embedding.layers.0"
