"""core.compat: the first difference between two workers' KV caches, over
maps the real planners make of random geometries, and through the wire."""

from __future__ import annotations

import dataclasses

import pytest
from geometry_strategies import geometries, geometry, view
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from kvmap.core import convert
from kvmap.core.compat import (
    INCOMPATIBLE,
    Incompatible,
    check_compatible,
    first_difference,
)
from kvmap.core.errors import ErrorCode
from kvmap.core.geometry import (
    CacheKind,
    ModelIdentity,
    RegionMapModel,
    ViewSpec,
    WorkerGeometry,
    WorkerKey,
)
from kvmap.core.planner import get_planner
from kvmap.core.retry import retryable

LLAMA = ModelIdentity(
    name="tiny-llama",
    revision="main",
    dtype="bfloat16",
    kv_cache_dtype="auto",
    config_digest="abc123",
)


def mapped(g: WorkerGeometry, planner: str = "coalesce", *, engine: str = "e") -> RegionMapModel:
    g = dataclasses.replace(g, worker=WorkerKey(engine))
    return convert.model_from_plan(g, get_planner(planner).plan(g), 1, {})


def with_model(g: WorkerGeometry, **changes: str) -> WorkerGeometry:
    return dataclasses.replace(g, model=dataclasses.replace(LLAMA, **changes))


def two_layers(kind: CacheKind = CacheKind.MHA, dtype: str = "bfloat16") -> WorkerGeometry:
    views = [
        dataclasses.replace(view(f"model.layers.{i}.self_attn", i * 64, 64, 128, kind=kind))
        for i in range(2)
    ]
    return with_model(geometry(*(dataclasses.replace(v, dtype=dtype) for v in views)))


@settings(max_examples=examples(150), deadline=None)
@given(
    geometries(),
    st.sampled_from(["baseline", "coalesce"]),
    st.sampled_from(["baseline", "coalesce"]),
)
def test_same_geometry_is_compatible_under_any_planners(
    g: WorkerGeometry, here: str, peer: str
) -> None:
    """A geometry is compatible with itself however each side planned it:
    regions may differ, the layers they hold do not."""
    g = with_model(g)
    assert first_difference(mapped(g, here), mapped(g, peer, engine="peer")) is None


@settings(max_examples=examples(150), deadline=None)
@given(geometries(), st.data())
def test_one_changed_layer_dtype_is_named(g: WorkerGeometry, data: st.DataObject) -> None:
    """Changing the dtype of one layer (all views of that name) makes that
    layer the difference, in the words of both sides; the check is
    symmetric in whether it finds a difference."""
    g = with_model(g)
    name = data.draw(st.sampled_from(sorted({v.layer_name for v in g.views})))
    changed = dataclasses.replace(
        g,
        views=tuple(
            dataclasses.replace(v, dtype="float16") if v.layer_name == name else v for v in g.views
        ),
    )
    here, peer = mapped(g), mapped(changed, engine="peer")
    assert first_difference(here, peer) == f"layer {name!r}: dtype uint8 here, float16 at the peer"
    assert first_difference(peer, here) is not None


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(ModelIdentity)])
def test_each_model_field_is_compared(field: str) -> None:
    """Each model identity field differs -> FAILED_PRECONDITION naming it
    with both values; an empty one (a peer that does not say) matches."""
    g = two_layers()
    here, peer = mapped(g), mapped(with_model(g, **{field: "other"}), engine="peer")
    with pytest.raises(Incompatible) as caught:
        check_compatible(here, peer)
    assert caught.value.code is ErrorCode.FAILED_PRECONDITION
    assert caught.value.reason == INCOMPATIBLE
    assert f"model {field}: {getattr(LLAMA, field)!r} here, 'other' at the peer" in str(
        caught.value
    )
    assert first_difference(here, mapped(with_model(g, **{field: ""}))) is None


def test_model_is_checked_before_layers() -> None:
    """Two differences: the model's is reported first (it explains the other)."""
    here = mapped(two_layers())
    peer = mapped(with_model(two_layers(dtype="float16"), name="other"), engine="peer")
    assert (first_difference(here, peer) or "").startswith("model name")


def test_layout_and_layer_sets_must_agree() -> None:
    """A different layout name, a layer only on one side, a different cache
    kind: each is the named difference."""
    g = two_layers()
    other_layout = dataclasses.replace(g, kv_cache_layout="LBHNC")
    assert first_difference(mapped(g), mapped(other_layout)) == (
        "KV cache layout 'BLHNC' here, 'LBHNC' at the peer"
    )
    fewer = dataclasses.replace(g, views=g.views[:1])
    assert first_difference(mapped(g), mapped(fewer)) == (
        "layer 'model.layers.1.self_attn' is here, not at the peer"
    )
    assert first_difference(mapped(fewer), mapped(g)) == (
        "layer 'model.layers.1.self_attn' is at the peer, not here"
    )
    assert first_difference(mapped(g), mapped(two_layers(CacheKind.MLA))) == (
        "layer 'model.layers.0.self_attn': cache kind MHA here, MLA at the peer"
    )


def _resized(g: WorkerGeometry, *, tokens: int, page: int, tp: int = 1) -> WorkerGeometry:
    views: list[ViewSpec] = [
        dataclasses.replace(
            v, offset_bytes=i * page, block_len_bytes=page, block_stride_bytes=2 * page
        )
        for i, v in enumerate(g.views)
    ]
    return dataclasses.replace(
        geometry(*views), block_size_tokens=tokens, tp_size=tp, model=g.model
    )


@pytest.mark.parametrize("kind", [CacheKind.MHA, CacheKind.MLA, CacheKind.INDEXER])
@pytest.mark.parametrize("peer_tokens", [8, 16, 32, 64])
def test_block_sizes_may_differ_at_equal_bytes_per_token(kind: CacheKind, peer_tokens: int) -> None:
    """Different block sizes are legal when a page holds the same bytes per
    token; a page of any other size is the named difference."""
    g = two_layers(kind)  # 16 tokens, 64 bytes: 4 bytes a token
    ok = _resized(g, tokens=peer_tokens, page=4 * peer_tokens)
    assert first_difference(mapped(g), mapped(ok)) is None
    bad = _resized(g, tokens=peer_tokens, page=4 * peer_tokens + 4)
    assert "-byte pages of" in (first_difference(mapped(g), mapped(bad)) or "")


@pytest.mark.parametrize("peer_tp", [1, 2, 4])
def test_tp_sizes_may_differ(peer_tp: int) -> None:
    """Another TP size is legal: a head-split layer's pages are the
    transfer planner's to check, a replicated layer's must still agree."""
    split = two_layers(CacheKind.MHA)
    per_rank = _resized(split, tokens=16, page=64 // peer_tp, tp=peer_tp)
    assert first_difference(mapped(split), mapped(per_rank)) is None
    mla = two_layers(CacheKind.MLA)
    same = _resized(mla, tokens=16, page=64, tp=peer_tp)
    assert first_difference(mapped(mla), mapped(same)) is None
    if peer_tp > 1:
        assert first_difference(mapped(mla), mapped(_resized(mla, tokens=16, page=32, tp=peer_tp)))


def test_per_block_state_compares_pages_only_at_equal_block_sizes() -> None:
    """A Mamba state is per block: equal block sizes need equal pages; other
    block sizes are not scaled (nothing to compare)."""
    g = two_layers(CacheKind.MAMBA)
    assert first_difference(mapped(g), mapped(_resized(g, tokens=16, page=32)))
    assert first_difference(mapped(g), mapped(_resized(g, tokens=32, page=32))) is None


@settings(max_examples=examples(100), deadline=None)
@given(geometries())
def test_model_and_dtypes_survive_the_wire(g: WorkerGeometry) -> None:
    """A map read back from its proto (what a peer's handshake carries) has
    the same model identity and layer dtypes, so the check sees them."""
    model = mapped(with_model(g))
    back = convert.region_map_from_proto(convert.region_map_to_proto(model))
    assert back.model == LLAMA
    assert [p.dtype for r in back.regions for p in r.layers] == [
        p.dtype for r in model.regions for p in r.layers
    ]
    assert first_difference(model, back) is None


def test_registration_model_reaches_the_map() -> None:
    """The registration's model identity becomes the map's."""
    req = convert.registry_pb2.RegisterWorkerRequest(
        worker=convert.worker_id_to_proto(WorkerKey("e")),
        model=convert.model_identity_to_proto(LLAMA),
    )
    assert convert.geometry_from_proto(req).model == LLAMA


def test_incompatibility_is_never_retried() -> None:
    """The retry classification treats an incompatibility as final."""
    assert not retryable(Incompatible("model name: 'a' here, 'b' at the peer"))
