"""The data round trip: text -> tokens -> .bin/.idx -> GPTDataset -> micro-batches, and the
checks that reject missing or corrupt data."""

import multiprocessing
import os
import time
import traceback
from pathlib import Path

import numpy
import pytest
import torch

from megatron.common.ports import reserved_port
from megatron.data.checks import DataError, check_data_prefix
from megatron.data.datasets import (
    DataBlend,
    batch_iterator,
    build_datasets,
    build_train_dataset,
    micro_batch_at,
)
from megatron.data.indexed_dataset_writer import write_indexed_dataset
from megatron.data.tokenizer import EOD_TOKEN, load_tokenizer, train_bpe_tokenizer

SEQ = 64
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
# ASCII documents of different lengths, each one recognizable by its number.
DOCUMENTS = [
    f"Record {i}: " + " ".join(WORDS[(i * j) % len(WORDS)] for j in range(3 + i % 17)) + "."
    for i in range(120)
]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    tokenizer = train_bpe_tokenizer(DOCUMENTS, 300, str(root / "tokenizer.json"))
    prefix = str(root / "docs")
    stats = write_indexed_dataset(DOCUMENTS, tokenizer, prefix, log=lambda _: None)
    return prefix, tokenizer, stats


def test_round_trip_batches_decode_to_the_source_documents(data, tmp_path):
    prefix, tokenizer, stats = data
    epoch_samples = (stats.tokens - 1) // SEQ  # every token once, one extra for the labels
    dataset = build_train_dataset(prefix, tokenizer, SEQ, epoch_samples, seed=7,
                                  cache_dir=str(tmp_path))
    assert len(dataset) == epoch_samples

    whole_documents_seen = set()
    batches = list(batch_iterator(dataset, micro_batch_size=4))
    assert len(batches) == epoch_samples // 4
    for batch in batches:
        assert set(batch) == {"tokens", "labels", "loss_mask", "position_ids"}
        assert batch["tokens"].shape == (4, SEQ) and batch["tokens"].dtype == torch.int64
        assert batch["labels"].dtype == torch.int64 and batch["loss_mask"].dtype == torch.float32
        assert torch.equal(batch["labels"][:, :-1], batch["tokens"][:, 1:])
        assert torch.equal(batch["loss_mask"], torch.ones(4, SEQ))
        assert torch.equal(batch["position_ids"], torch.arange(SEQ).expand(4, SEQ))
        for row in range(4):
            ids = batch["tokens"][row].tolist() + [batch["labels"][row, -1].item()]
            pieces = tokenizer.detokenize(ids).split(EOD_TOKEN)
            assert all(any(p in doc for doc in DOCUMENTS) for p in pieces), pieces
            # Text between two EODs is one complete document.
            for piece in pieces[1:-1]:
                assert piece in DOCUMENTS
                whole_documents_seen.add(piece)
    assert len(whole_documents_seen) > len(DOCUMENTS) // 2


def test_micro_batch_at_matches_the_iterator_and_resumes(data, tmp_path):
    prefix, tokenizer, _ = data
    dataset = build_train_dataset(prefix, tokenizer, SEQ, 40, seed=3, cache_dir=str(tmp_path))
    in_order = list(batch_iterator(dataset, 2))
    for index in (0, 1, 5):
        assert torch.equal(micro_batch_at(dataset, 2, index)["tokens"], in_order[index]["tokens"])
    resumed = next(batch_iterator(dataset, 2, start_sample=6))
    assert torch.equal(resumed["labels"], in_order[3]["labels"])
    with pytest.raises(IndexError, match="micro-batch"):
        micro_batch_at(dataset, 2, len(dataset))


def test_same_seed_same_order_other_seed_other_order(data, tmp_path):
    prefix, tokenizer, _ = data

    def first_tokens(seed, cache):
        ds = build_train_dataset(prefix, tokenizer, SEQ, 40, seed=seed, cache_dir=str(cache))
        return micro_batch_at(ds, 8, 0)["tokens"]

    a = first_tokens(1, tmp_path / "a")
    assert torch.equal(a, first_tokens(1, tmp_path / "b"))  # rebuilt from scratch
    assert torch.equal(a, first_tokens(1, tmp_path / "a"))  # read from the cache
    assert not torch.equal(a, first_tokens(2, tmp_path / "a"))


def test_index_cache_lives_in_the_cache_dir_and_survives_a_truncated_file(data, tmp_path):
    prefix, tokenizer, _ = data
    data_dir_before = sorted(os.listdir(os.path.dirname(prefix)))
    dataset = build_train_dataset(prefix, tokenizer, SEQ, 40, seed=5, cache_dir=str(tmp_path))
    expected = micro_batch_at(dataset, 4, 2)["tokens"]
    assert sorted(os.listdir(os.path.dirname(prefix))) == data_dir_before
    npy = sorted(tmp_path.rglob("*shuffle_index.npy"))
    assert len(npy) == 1
    # What a build killed while writing leaves behind.
    npy[0].write_bytes(npy[0].read_bytes()[:20])
    dataset = build_train_dataset(prefix, tokenizer, SEQ, 40, seed=5, cache_dir=str(tmp_path))
    assert torch.equal(micro_batch_at(dataset, 4, 2)["tokens"], expected)


def _build_in_child(prefix, tokenizer_path, cache_dir, barrier, results, rank, world):
    try:
        if world:
            torch.distributed.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{world[1]}", rank=rank, world_size=world[0]
            )
        barrier.wait()
        tokenizer = load_tokenizer(tokenizer_path)
        dataset = build_train_dataset(prefix, tokenizer, SEQ, 60, seed=11, cache_dir=cache_dir)
        results.put((rank, [micro_batch_at(dataset, 3, i)["tokens"].tolist() for i in range(4)]))
        if world:
            torch.distributed.destroy_process_group()
    except BaseException:
        results.put((rank, traceback.format_exc()))


def _run_two_builders(data, cache_dir: Path, distributed: bool):
    prefix, tokenizer, _ = data
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    with reserved_port() as port:  # rank 0's store binds it in its process
        world = (2, port) if distributed else None
        procs = [
            ctx.Process(target=_build_in_child,
                        args=(prefix, tokenizer.path, str(cache_dir), barrier, results, r, world))
            for r in range(2)
        ]
        for p in procs:
            p.start()
        try:
            outcome = dict(results.get(timeout=120) for _ in procs)
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
                    p.join()
    for rank, result in outcome.items():
        assert not isinstance(result, str), f"rank {rank} failed:\n{result}"
    return outcome


@pytest.mark.parametrize("distributed", [False, True], ids=["file-lock", "torch-distributed"])
def test_concurrent_processes_build_one_index_and_see_the_same_batches(
    data, tmp_path, distributed
):
    outcome = _run_two_builders(data, tmp_path, distributed)
    assert outcome[0] == outcome[1]
    # One consistent set of index files (one hash), the lock, no temporaries.
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    index_files = sorted(p.name.split("-", 1)[1] for p in files if p.suffix != ".lock")
    assert index_files == [
        "SplitGPTDataset-train-description.txt", "SplitGPTDataset-train-document_index.npy",
        "SplitGPTDataset-train-sample_index.npy", "SplitGPTDataset-train-shuffle_index.npy",
    ]
    assert len({p.name.split("-", 1)[0] for p in files if p.suffix != ".lock"}) == 1
    assert len(files) == len(index_files) + 1
    prefix, tokenizer, _ = data
    in_process = build_train_dataset(prefix, tokenizer, SEQ, 60, seed=11, cache_dir=str(tmp_path))
    assert outcome[0][2] == micro_batch_at(in_process, 3, 2)["tokens"].tolist()


def _copy_prefix(prefix: str, dest: Path) -> str:
    for ext in (".bin", ".idx"):
        (dest / f"copy{ext}").write_bytes(Path(prefix + ext).read_bytes())
    return str(dest / "copy")


def test_check_data_prefix_accepts_good_data(data):
    prefix, tokenizer, _ = data
    check_data_prefix(prefix)
    check_data_prefix(prefix, vocab_size=tokenizer.vocab_size)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: os.unlink(p + ".bin"), r"copy\.bin': file not found"),
        (lambda p: os.unlink(p + ".idx"), r"copy\.idx': file not found"),
        (lambda p: Path(p + ".bin").write_bytes(Path(p + ".bin").read_bytes()[:-6]),
         r"copy\.bin': \d+ bytes, expected \d+"),
        (lambda p: Path(p + ".idx").write_bytes(b"not an index at all"),
         r"copy\.idx': not a readable Megatron index"),
        (lambda p: Path(p + ".idx").write_bytes(Path(p + ".idx").read_bytes()[:40]),
         r"copy\.idx': not a readable Megatron index"),
        (lambda p: Path(p + ".idx").write_bytes(b""), r"copy\.idx': not a readable"),
    ],
    ids=["no-bin", "no-idx", "truncated-bin", "garbage-idx", "truncated-idx", "empty-idx"],
)
def test_check_data_prefix_rejects_missing_or_corrupt_files(data, tmp_path, damage, message):
    prefix = _copy_prefix(data[0], tmp_path)
    damage(prefix)
    with pytest.raises(DataError, match=message):
        check_data_prefix(prefix)


def test_a_prefix_given_with_its_extension_names_the_prefix(data, tmp_path):
    prefix = _copy_prefix(data[0], tmp_path)
    for extension in (".bin", ".idx"):
        with pytest.raises(DataError, match=f"file not found; expected the prefix without "
                                            f"\\{extension}: {prefix}$"):
            check_data_prefix(prefix + extension)


def test_data_made_with_a_larger_vocabulary_is_rejected(data, tmp_path):
    prefix, tokenizer, _ = data
    biggest = int(numpy.fromfile(prefix + ".bin", dtype=numpy.uint16).max())
    with pytest.raises(DataError, match=f"token id {biggest} does not fit"):
        check_data_prefix(prefix, vocab_size=biggest)
    with pytest.raises(DataError, match="does not fit"):
        build_train_dataset(prefix, type("Small", (), {"vocab_size": biggest})(), SEQ, 4, 0,
                            cache_dir=str(tmp_path))


def test_a_split_without_documents_is_refused_in_one_line_not_a_hang(data, tmp_path):
    """120 documents split 969,30,1 (Megatron's default) leave the test share empty:
    megatron-core would count epochs forever to find its samples."""
    prefix, tokenizer, _ = data
    started = time.monotonic()
    with pytest.raises(DataError, match="test split has no tokens.*--eval-iters 0"):
        build_datasets(DataBlend([prefix], None, "969,30,1"), tokenizer, SEQ, [8, 8, 8],
                       seed=1, cache_dir=str(tmp_path))
    assert time.monotonic() - started < 30


def test_a_batch_far_too_large_for_the_corpus_is_refused_before_its_index_is_built(
        data, tmp_path):
    """Ten billion samples of 120 short documents: megatron-core would build an index of
    hundreds of GiB; the build stops at once and says why."""
    prefix, tokenizer, _ = data
    started = time.monotonic()
    with pytest.raises(DataError, match="passes over its 120 documents: an index of"):
        build_datasets(DataBlend([prefix], None, "1,0,0"), tokenizer, SEQ, [10**10, 0, 0],
                       seed=1, cache_dir=str(tmp_path))
    assert time.monotonic() - started < 30
