"""``PackedStream``: documents of a tokenized corpus laid end to end into fixed ``[batch, seq_len]`` batches.

The plan is the stream plan with tokens as rows (``plan/packing_plan.py``): blocks balanced by tokens, so
padding is only each worker's last batch; every token exactly once per epoch; the checkpoint contract
of every stream (``streams/stream_base.py``), so ``StreamLoader`` resumes it on any topology. A blend is
packed corpus by corpus and blends sequences, planned like a blend's positions (``PackedBlendBatches``).
"""

from __future__ import annotations

import logging
import threading
from functools import partial
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from ..plan.batch_plan import BatchSpec, Read, Schedule, StreamSchedule
from .blend import BlendedStream
from ..loader.handoff import batches_per_message
from .planning_room import check_planning_room
from ..plan.blend_plan import BlendMap, CorpusOrder, blend_length, position_config, position_layout
from ..plan.blend_schedule import blend_counts
from .dataset import ParquetStream
from .delivery import deliver
from ..io.fetch import ReadStats
from ..errors import CatalogError, ConversionError, ReadError, StateError
from ..plan.elastic import Segment
from ..plan.packing_plan import PackedBlendBatches, TokenGroup, pack, segment_bounds, token_counts, token_group
from ..plan.packing_stages import StageCounts, StagedPlanner, StagedSchedule, Stages
from ..plan.blend_stages import BlendStages, CorpusTokens, StagedBlendBatches, corpus_first_bytes
from ..plan.epoch_plan import EpochPlan, Layout, PlanConfig, stream_order
from ..io.reader import RowGroupReader
from ..plan.resume import Planner, Position, Start
from ..plan.steering import SteerSpec, WeightSteering
from .stream_base import PlannedStream
from ..convert.tensors import Batch
from ..io import collective
from ..io.count_share import Claim, CountShare
from ..io.text_counts import count_text_tokens, row_group_texts
from .stage_counting import count_later_stages, count_later_stages_alone, rank_counting
from ..convert.text_tokenizer import TextTokenizer
from ..io.token_count_cache import TokenCountCache
from ..plan.topology import current_worker
from ..plan.validate import check_int

log = logging.getLogger("streamshard")
TOKENS = "input_ids"  # the batch key of the ids of a tokenized text column
FIRST_STAGE_BYTES = 8 << 20  # compressed text in a cold text epoch's first counting stage: a few seconds to count


class PackedStream(WeightSteering, PlannedStream):
    """Pack the documents of ``source`` (a tokenized ``ParquetStream`` or ``BlendedStream``) into
    fixed-length sequences.

    Each batch holds ``batch_size`` sequences of ``seq_len`` tokens::

        batch["input_ids"]     # [B, L], the column's dtype: documents laid end to end
        batch["position_ids"]  # int64 [B, L]: position inside the document's fragment in this sequence
        batch["sample_id"]     # int64 [B, L]: the source row of each token; -1 = padding token
        batch["corpus"]        # int64 [B, L], blends only: the corpus of each token; -1 = padding

    A document longer than what is left of a sequence continues in the next sequence (the next
    batch, or another worker's first one); its positions restart at 0 there, and ``sample_id``
    says it is the same document. ``cu_seqlens(batch["position_ids"])`` gives the segment offsets
    for varlen attention. Every token of every document is delivered exactly once per epoch over
    all ranks and workers; work is balanced by tokens, so only each worker's last batch pads.

    From a ``ParquetStream`` the pack uses its catalog (paths, storage options), ``unit``,
    ``shuffle``, ``seed`` (documents are shuffled within each row group and row groups or files in
    the stream, as for the source), ``read_ahead`` and its rank/world size; its ``batch_size``,
    ``shuffle_window``, ``uneven`` and ``transform`` do not apply, and columns other than the packed
    ones are not read.

    From a ``BlendedStream`` it uses the weights, ``stop``, ``order``, ``seed`` and topology, and
    blends *sequences*: each corpus's epoch is packed on its own (its documents as above) into
    ``ceil(tokens / seq_len)`` sequences, the last one padded in place, and the blend's weights and
    exact per-corpus counts (:meth:`counts`) apply to those sequences, i.e. to tokens. Every
    sequence holds one corpus's tokens. An explicit ``num_samples`` of the blend counts sequences;
    the blend's ``batch_size`` and ``transform`` do not apply.
    (Documents cannot be the blended unit here: equal steps need each worker's token count before
    reading, and the footers give tokens per row group, not per document.)

    Raw text (``tokenizer=``): ``column`` is a string column, tokenized inside the pipeline and
    packed as above under the key ``"input_ids"`` (int64). The plan needs token counts before
    reading, and only a tokenizer knows them, so a text epoch is planned in *stages*
    (``plan/packing_stages.py``): its row groups, in the epoch's order, are cut into stages of growing
    size (the first holds ``first_stage_bytes`` of compressed text, each next one twice the last),
    and each stage is planned on its own once counted (equal full batches per global worker, the
    leftover tokens carried into the next stage; only the epoch's last batches pad). ``set_epoch``
    counts the first stage (split over the ranks of an initialised process group, with a progress
    bar on a terminal) and a background thread counts the others while training runs (split over
    the same ranks: the default group's, or a device mesh's data-parallel group's with
    ``mesh=mesh["dp"]``; ``streams/stage_counting.py``); a stage not
    counted when training reaches it is counted then. Such a stream has no ``len()`` (a
    ``TypeError``, as for any iterable dataset without a length, whether its counts are cached or
    not: every rank answers alike), so a framework that asks for it before the first step (Lightning)
    runs the epoch to its end instead of waiting for the whole count; ``epoch_length(num_workers)``
    waits for the count and gives the exact number, and ``sized=True`` makes ``len()`` do that.
    Counts are kept in the source's ``catalog_cache`` directory, keyed by file version and
    tokenizer identity, so a warm start reads one JSON file (``io/token_count_cache.py``) and plans the
    same stages, hence the same batches. A blend of text corpora with an explicit ``num_samples`` is
    planned in stages by its positions (``plan/blend_stages.py``: each stage the positions whose
    sequences lie in every corpus's counted stages; ``set_epoch`` counts every corpus's first stage,
    the rest is counted beside training, split over the ranks as above; ``set_weights`` is refused there); one without ``num_samples``
    takes its length from every corpus's total, so it counts everything first. Reading tokenizes again on the
    read-ahead threads, beside training, and checks each row group gives the counted tokens.
    No special token is added silently: a ``tokenizers.Tokenizer`` is called with
    ``add_special_tokens=False``; ``bos_id``/``eos_id`` put one token before/after every document.

    Args:
        source: the ``ParquetStream`` or ``BlendedStream`` to pack.
        column: the list-of-integers column holding the tokens; with ``tokenizer``, the text column.
        seq_len, batch_size: the shape of a batch.
        columns: more list columns to pack alongside, row by row of the same length as ``column``
            (labels, loss masks); a row whose lengths differ is an error naming file and row group.
            Not with ``tokenizer``.
        transform: called on each batch inside the worker.
        tokenizer: a ``tokenizers.Tokenizer``, a transformers fast tokenizer (its
            ``backend_tokenizer`` is used) or a callable ``list[str] -> list[list[int]]``.
        bos_id, eos_id: a token put before / after every (non-null) document; None: none.
        tokenizer_name: a callable tokenizer's identity for the count cache (a version string you
            change whenever its output can change); without it a callable's counts are not cached.
            A ``tokenizers.Tokenizer`` is identified by the hash of its JSON and takes no name.
        first_stage_bytes: with ``tokenizer``, the compressed bytes of text (from the footers) in an
            epoch's first counting stage, which ``set_epoch`` counts before the first step (a blend
            with ``num_samples``: shared by its corpora by their positions). Part of the order
            (states record it).
        sized: with ``tokenizer`` (a single corpus, or a blend with ``num_samples``), whether ``len()``
            is defined: None or False (the default), no length, so training starts after the first
            stage; True, ``len()`` waits for the whole count and gives the exact number (a framework's
            progress total, Lightning's ``estimated_stepping_batches``). Other packs always have a
            length (False is refused).
    """

    def __init__(self, source: ParquetStream | BlendedStream, column: str = "input_ids", seq_len: int = 2048,
                 batch_size: int = 8, columns: Sequence[str] = (),
                 transform: Callable[[Batch], Any] | None = None, tokenizer: Any = None,
                 bos_id: int | None = None, eos_id: int | None = None, tokenizer_name: str | None = None,
                 first_stage_bytes: int = FIRST_STAGE_BYTES, sized: bool | None = None) -> None:
        super().__init__()
        if not isinstance(source, (ParquetStream, BlendedStream)):
            raise ValueError(f"PackedStream packs a ParquetStream or a BlendedStream; got {type(source).__name__}")
        if not isinstance(column, str) or isinstance(columns, str) or not all(isinstance(c, str) for c in columns):
            raise ValueError(f"column must be a column name and columns a list of names, got {column!r}, {columns!r}")
        if column in columns or len(set(columns)) != len(columns):
            raise ValueError(f"columns {list(columns)} repeat a column or the token column {column!r}")
        if transform is not None and not callable(transform):
            raise ValueError(f"transform must be callable, got {transform!r}")
        self.text: TextTokenizer | None = None
        if tokenizer is not None:
            if columns:
                raise ValueError(f"columns={list(columns)} packs token columns alongside; a tokenized text column "
                                 "packs alone (tokenizer= given)")
            self.text = TextTokenizer(tokenizer, bos_id, eos_id, tokenizer_name)
        elif bos_id is not None or eos_id is not None or tokenizer_name is not None:
            raise ValueError("bos_id, eos_id and tokenizer_name are for a text column with tokenizer=; a token "
                             "column is packed as it is")
        self.source, self.column, self.columns = source, column, [column, *columns]
        self.blend = source if isinstance(source, BlendedStream) else None
        self.corpora: list[ParquetStream] = list(source.datasets) if self.blend is not None else [source]
        self.seq_len = check_int(seq_len, "seq_len", 1)
        self.batch_size = check_int(batch_size, "batch_size", 1)
        self.transform = transform
        self._tokens: list[np.ndarray] | None = None  # per corpus, per row group of its catalog, from the footers
        self._dtypes: dict[str, np.dtype] | None = None
        self._sequences: int | None = None
        self.first_stage_bytes = check_int(first_stage_bytes, "first_stage_bytes", 1)
        self._staged = self.text is not None and self.blend is None  # a text epoch planned in stages
        # A blend of text corpora of explicit length: its positions planned in stages (plan/blend_stages.py).
        self._staged_blend = self.text is not None and self.blend is not None and self.blend._num_samples is not None
        in_stages = self._staged or self._staged_blend
        if first_stage_bytes != FIRST_STAGE_BYTES and not in_stages:
            raise ValueError("first_stage_bytes sizes the first counted stage of a raw-text corpus or of a blend of "
                             "them with num_samples (tokenizer=); " + (
                                 "a blend of text corpora without num_samples is counted whole before its first step"
                                 if self.text is not None else "a token column needs no counting"))
        if sized is not None and not isinstance(sized, bool):
            raise ValueError(f"sized must be True, False or None, got {sized!r}")
        if sized is False and not in_stages:
            raise ValueError("sized=False is for a raw-text corpus (tokenizer=) or a blend of them with num_samples, "
                             "whose length needs the whole token count; this pack's length is known before its "
                             "first step")
        self._sized = sized is not False if not in_stages else bool(sized)
        self._counts: StageCounts | None = None  # staged: tokens per row group, filled a stage at a time
        self._stages: tuple[int, Stages] | None = None  # staged: the last epoch's stages
        self._counter: threading.Thread | None = None  # staged: the thread counting the later stages
        self._blend_counts: list[StageCounts] | None = None  # staged blend: each corpus's tokens per row group
        self._blend_tokens: list[CorpusTokens | None] | None = None  # staged blend: each corpus's sequences
        self._blend_stages: dict[int, BlendStages] = {}  # staged blend: per epoch
        self._count_share = CountShare.owned_by(self)  # text: counts its worker processes share (a token only)
        self._init_steering()

    @property
    def sized(self) -> bool:
        """Whether ``len()`` is defined: False for a raw-text corpus unless ``sized=True`` (its length
        needs every stage counted, so a framework that asks for it before the first step would wait
        for the whole count; without a length it runs the epoch to its end)."""
        return self._sized

    @property
    def holds_gil(self) -> bool:
        """Whether reading runs Python that holds the GIL (a callable tokenizer): ``StreamLoader`` then
        runs its workers as processes, so tokenizing does not compete with the training loop."""
        return self.text is not None and not self.text.releases_gil

    @property
    def topology(self) -> tuple[int, int]:
        """The source's rank and world size."""
        return self.source.topology

    # -- what decides the order ----------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch; also reads the footers once here, so DataLoader workers inherit the counts
        (a text epoch: counts its first stage and starts counting the others in the background)."""
        super().set_epoch(epoch)
        if self._staged:
            self._count_first_stage(epoch)
        elif self._staged_blend:
            self._count_blend_first_stage(epoch)
        else:
            self._token_counts()

    @property
    def tokens(self) -> np.ndarray:
        """Tokens of each row group of the source's catalog (int64, from the footers); for a blend, of
        each corpus's catalog one after the other, in the blend's ``names`` order."""
        return np.concatenate(self._token_counts())

    @property
    def num_tokens(self) -> int:
        """Tokens in one epoch of the source (for a blend: one epoch of each corpus)."""
        return int(self.tokens.sum())

    def counts(self) -> dict[str, int]:
        """A blend's sequences per corpus in one blend epoch (exact, by weight)."""
        if self.blend is None:
            raise TypeError("counts() is for a packed BlendedStream; a packed ParquetStream has one corpus")
        return dict(zip(self.blend.names, blend_counts(self.blend.weights, self.num_sequences).tolist()))

    @property
    def num_sequences(self) -> int:
        """Sequences per epoch: for a blend, the blend's length in sequences (``stop`` applied to each
        corpus's sequences, or its explicit ``num_samples``); otherwise ``ceil(num_tokens / seq_len)``."""
        if self._sequences is None and self._staged_blend:
            assert self.blend is not None and self.blend._num_samples is not None
            self._sequences = self.blend._num_samples  # a corpus of no tokens is found when its sequences are located
        if self._sequences is None:
            per_corpus = [-(-int(t.sum()) // self.seq_len) for t in self._token_counts()]
            if self.blend is None:
                self._sequences = per_corpus[0]
            else:
                explicit = self.blend._num_samples
                n = explicit if explicit is not None else blend_length(self.blend.weights, per_corpus, self.blend.stop)
                counts = blend_counts(self.blend.weights, n)
                for name, count, size in zip(self.blend.names, counts.tolist(), per_corpus):
                    if count and not size:
                        raise ValueError(f"corpus {name!r} has no tokens in column {self.column!r} but its weight "
                                         f"gives it {count} of {n} sequences")
                self._sequences = n
        return self._sequences

    @property
    def shuffled(self) -> bool:
        return self.source.shuffled

    def _batches_a_message(self) -> int:
        """``PlannedStream._batches_a_message``: a batch is ``batch_size x seq_len`` tokens of at most 8 bytes
        in each of its keys (the packed columns, ``position_ids``, ``sample_id``; ``corpus`` in a blend).
        Raw text goes one a message: tokenizing costs far more than a message, and a worker's first message
        must not wait for batches of a stage still being counted (a cold start's first step)."""
        if self.text is not None:
            return 1
        keys = len(self.columns) + 2 + (self.blend is not None)
        return batches_per_message(8.0 * keys * self.batch_size * self.seq_len)

    @property
    def planner(self) -> Planner | StagedPlanner:  # type: ignore[override]
        if self._staged:
            return StagedPlanner(self._epoch_stages, self._stage_counts(), self._token_config(0))
        if self._staged_blend:
            return StagedPlanner(self._blend_epoch_stages, None, position_config(self.batch_size))
        if self.blend is not None:
            return Planner(position_layout(self.num_sequences), position_config(self.batch_size), None)
        return Planner(self._token_layout(0), self._token_config(0), None)

    def fingerprint(self) -> dict[str, Any]:
        def corpus(ds: ParquetStream) -> dict[str, Any]:
            return {k: v for k, v in ds.fingerprint().items() if k not in ("batch_size", "shuffle_window", "uneven", "columns")}

        packing = {"packed_columns": self.columns, "seq_len": self.seq_len, "batch_size": self.batch_size}
        if self.text is not None:
            packing["tokenizer"] = self.text.identity or "an unnamed callable"
        if self._staged:  # no total: a state saved during a cold start does not wait for the whole count
            return {**corpus(self.source), **packing, "first_stage_bytes": self.first_stage_bytes}
        if self.blend is None:
            return {**corpus(self.source), **packing, "tokens": self.num_tokens}
        blend = self.blend
        fields = {"corpora": [{"name": n, **corpus(ds)} for n, ds in zip(blend.names, blend.datasets)],
                  "weights": blend.weights.tolist(), "seed": blend.seed, "stop": blend.stop, "order": blend.order,
                  "num_sequences": self.num_sequences, **packing}
        if self._staged_blend:  # no totals, as for one corpus
            return {**fields, "first_stage_bytes": self.first_stage_bytes}
        return {**fields, "tokens": [int(t.sum()) for t in self._token_counts()]}

    def schedule(self, worker_id: int = 0, num_workers: int = 0) -> Schedule:
        """The exact batches DataLoader worker ``worker_id`` of this rank delivers in this pass, without reading."""
        return self._schedule(self._start(self.origin(), worker_id, num_workers))

    def _schedule(self, start: Start) -> Schedule:
        if self.blend is None:
            return start.schedule
        if self.blend.weight_changes:
            raise ValueError("the BlendedStream inside this PackedStream had its weights changed; a pack blends sequences, "
                             "so call set_weights on the PackedStream")
        if self._staged_blend:
            assert isinstance(start.schedule, StagedSchedule)
            stages = self._blend_epoch_stages(start.schedule.plans.epoch)
            return StagedBlendBatches(start.schedule, stages.blend, self._corpus_tokens(), self.seq_len,  # type: ignore[arg-type]
                                      self.batch_size)
        assert isinstance(start.schedule, StreamSchedule)
        epoch = start.schedule.plan.epoch
        blend: Any = BlendMap(self.blend.weights, self.num_sequences, self.blend.order, self.blend.seed, epoch)
        if self._changes:
            blend = self._steered().epoch_map(epoch)
        corpora = [CorpusOrder(self._token_layout(k), self._token_config(k)) for k in range(len(self.corpora))]
        return PackedBlendBatches(start.schedule, blend, corpora, self.seq_len)

    # -- steering a packed blend: its weights apply to sequences ----------------------------------
    @property
    def _steerable(self) -> bool:
        return self.blend is not None

    def set_weights(self, weights: Any) -> None:
        """``WeightSteering.set_weights``; refused for a blend of text corpora with ``num_samples`` (its
        positions are planned in stages, and steering needs every corpus's sequence count)."""
        if self._staged_blend:
            raise TypeError(_NO_STEERING)
        super().set_weights(weights)

    def _use_changes(self, changes: list[Any]) -> None:
        if changes and self._staged_blend:
            raise StateError(f"weight_changes: {_NO_STEERING}")
        super()._use_changes(changes)

    def _parse_changes(self, raw: Any) -> list[Any]:
        if self._staged_blend:  # none may be recorded (and checking none needs no count)
            if raw != []:
                raise StateError(f"state['weight_changes'] must be [] here ({_NO_STEERING}), got {raw!r:.80}")
            return []
        return super()._parse_changes(raw)

    def _steer_spec(self) -> SteerSpec:
        assert self.blend is not None
        sequences = np.array([-(-int(t.sum()) // self.seq_len) for t in self._token_counts()], dtype=np.int64)
        return SteerSpec(self.blend.names, self.blend.weights, self.num_sequences, self.blend.order, self.blend.seed,
                         sequences)

    def step_sample_ids(self, step: int, num_workers: int = 0, epoch: int | None = None) -> list[dict[str, Any]]:
        """Not available for a pack: which document a token belongs to depends on the documents'
        lengths, which only the data holds (the plan knows token positions, not documents)."""
        raise NotImplementedError(
            "PackedStream.step_sample_ids: a token's document id needs the documents' lengths, which are in the data, "
            "not the footers; ask the source stream for the rows of its batches, or record batch['sample_id']")

    def _token_layout(self, k: int) -> Layout:
        return Layout(self._token_counts()[k], self.corpora[k].catalog.rg_file)

    def _token_config(self, k: int) -> PlanConfig:
        """A corpus's stream order with tokens as rows (documents are ordered inside each token group)."""
        config = self.corpora[k].config
        return PlanConfig(unit=config.unit, shuffle=config.shuffle, seed=config.seed,
                          batch_size=self.batch_size * self.seq_len, uneven="pad", shuffle_rows=False)

    # -- iteration ----------------------------------------------------------------------------
    def position_after(self, origin: Position, consumed: int, num_workers: int) -> Position:
        """``PlannedStream.position_after``; for a text epoch, without counting the stages past it."""
        planner = self.planner
        # Unknown (the next stage is still counting): the position inside the epoch, which a load turns
        # into the next epoch's start if it was the end (``_parse_state``).
        if isinstance(planner, StagedPlanner) and planner.has_batch(origin.epoch, origin, self.world_size, num_workers,
                                                                    consumed) is not False:
            history, before = planner.split(origin, self.world_size, num_workers)
            return Position(origin.epoch, history + [Segment(self.world_size, num_workers, before + consumed)])
        return super().position_after(origin, consumed, num_workers)

    def _ended(self, position: Position) -> bool:
        """``PlannedStream._ended``; for a text epoch, counting only the stages up to ``position`` unless it
        sits where the next stage decides it (a plan's end)."""
        planner = self.planner
        if isinstance(planner, StagedPlanner):
            last = position.history[-1]
            more = planner.has_batch(position.epoch, position, last.world_size, last.num_workers, 0)
            if more is not None:
                return not more
        return super()._ended(position)

    def _before_pass(self, start: Start, worker_id: int, num_workers: int) -> None:
        # A token column's counts come from its footers, so a damaged one may claim billions of tokens
        # (a text column's are counted by tokenizing: real).
        if self.text is None and self.blend is None and isinstance(start.schedule, StreamSchedule):
            catalog = self.source.catalog
            check_planning_room(start.schedule, catalog.place, self._token_counts()[0], "tokens")

    def _deliver(self, start: Start) -> Iterator[Any]:
        if not self._staged and not self._staged_blend:
            self._token_counts()  # counted in the main process when set_epoch was called there
        self._column_dtypes()
        assert self._dtypes is not None
        dtypes = self._dtypes
        readers: dict[int, RowGroupReader] = {}
        documents: dict[tuple[int, int], EpochPlan] = {}
        first_ids = [ds.catalog.layout.rg_first_id for ds in self.corpora]

        def read(what: Read) -> TokenGroup:
            k, epoch = what.source, (what.epoch if self.blend is not None else self.epoch)
            ds = self.corpora[k]
            if k not in readers:
                readers[k] = RowGroupReader.from_catalog(ds.catalog, ds.storage_options, columns=self.columns)
            if (k, epoch) not in documents:  # the source's row order of that (corpus) epoch
                documents[(k, epoch)] = EpochPlan(ds.catalog.layout, ds.config, epoch, 1)
            if self.text is not None:
                return self._text_group(readers[k], k, what.rg, documents[(k, epoch)])
            return self._token_group(readers[k], k, what.rg, documents[(k, epoch)])

        def assemble(spec: BatchSpec, groups: dict[int, TokenGroup]) -> Batch:
            arrays = pack(spec, groups, first_ids, self.seq_len, self.batch_size, dtypes)
            return {name: torch.from_numpy(array) for name, array in arrays.items()}

        read_ahead = max(ds.read_ahead for ds in self.corpora)
        stats = self._delivery_stats(ReadStats(), start.worker_id)
        batches = deliver(self._schedule(start), start.start, read, None, read_ahead, stats, assemble)
        yield from self._each_delivered(batches, readers, stats, self.transform)

    def _token_group(self, reader: RowGroupReader, k: int, rg: int, documents: EpochPlan) -> TokenGroup:
        catalog, tokens = self.corpora[k].catalog, self._token_counts()[k]
        file_index, index = int(catalog.rg_file[rg]), int(catalog.rg_index[rg])
        where = f"{catalog.urls[file_index]}: row group {index}"
        table = reader.read(file_index, index)
        lists = {name: table.column(name).combine_chunks() for name in self.columns}
        lengths = pc.fill_null(pc.list_value_length(lists[self.column]), 0).to_numpy().astype(np.int64)
        values = {}
        for name, array in lists.items():
            mine = pc.fill_null(pc.list_value_length(array), 0).to_numpy().astype(np.int64)
            if not np.array_equal(mine, lengths):
                row = int(np.flatnonzero(mine != lengths)[0])
                raise ConversionError(f"{where}: column {name!r} has {mine[row]} values in row {row} but "
                                      f"{self.column!r} has {lengths[row]}; packed columns must match row by row")
            flat = array.flatten()
            if flat.null_count:
                raise ConversionError(f"{where}: column {name!r} has null values inside its lists; packing needs numbers")
            values[name] = flat.to_numpy(zero_copy_only=False)
        if len(lengths) != catalog.rg_rows[rg] or int(lengths.sum()) != int(tokens[rg]):
            raise ReadError(f"{where}: {len(lengths)} rows and {int(lengths.sum())} tokens, but the footer said "
                            f"{int(catalog.rg_rows[rg])} rows and {int(tokens[rg])} tokens; did the file change?")
        return _in_document_order(lengths, values, rg, documents)

    def _text_group(self, reader: RowGroupReader, k: int, rg: int, documents: EpochPlan) -> TokenGroup:
        """A text row group tokenized (on the read-ahead thread that read it), checked against its count."""
        assert self.text is not None
        catalog = self.corpora[k].catalog
        tokens = (self._counts_of(k).tokens if self._staged or self._staged_blend
                  else self._token_counts()[k])  # counted when planned
        file_index, index = int(catalog.rg_file[rg]), int(catalog.rg_index[rg])
        where = f"{catalog.urls[file_index]}: row group {index}"
        texts = row_group_texts(reader.read(file_index, index), self.column)
        lengths, ids = self.text.encode(texts, where)
        if len(lengths) != catalog.rg_rows[rg] or int(lengths.sum()) != int(tokens[rg]):
            raise ReadError(f"{where}: {len(lengths)} rows tokenized to {int(lengths.sum())} tokens, but "
                            f"{int(catalog.rg_rows[rg])} rows and {int(tokens[rg])} tokens were counted before the "
                            "epoch was planned: the file changed, the tokenizer is not deterministic, or a cached "
                            "count belongs to another tokenizer under the same tokenizer_name (delete the "
                            "tokens-*.json files of the catalog cache)")
        return _in_document_order(lengths, {TOKENS: ids}, rg, documents)

    def _token_counts(self) -> list[np.ndarray]:
        """Tokens per row group of each corpus, from the catalogs' footer summaries (read once); checks
        the packed columns on the way."""
        if self._tokens is None:
            self._column_dtypes()
            if self.text is None:
                self._tokens = [token_counts(ds.catalog, self.column) for ds in self.corpora]
            elif self._staged or self._staged_blend:  # every stage (len(), num_tokens): waits for the count
                self._tokens = [self._counts_of(k).of(np.arange(len(self._counts_of(k).tokens), dtype=np.int64))
                                for k in range(len(self.corpora))]
            else:
                self._tokens = [self._count_text(_share_name(i), ds) for i, ds in enumerate(self.corpora)]
        return self._tokens

    def _column_dtypes(self) -> dict[str, np.dtype]:
        """The packed columns' dtypes (checked once against every corpus's schema)."""
        if self._dtypes is None:
            names = self.blend.names if self.blend is not None else ("source",)
            dtypes: dict[str, np.dtype] | None = None
            for name, ds in zip(names, self.corpora):
                mine = self._check_columns(ds.catalog.schema, "the source" if self.blend is None else f"corpus {name!r}")
                if dtypes is not None and mine != dtypes:
                    raise ValueError(f"corpora {names[0]!r} and {name!r} give the packed columns different dtypes: "
                                     f"{ {k: str(v) for k, v in dtypes.items()} } vs { {k: str(v) for k, v in mine.items()} }")
                dtypes = mine
            assert dtypes is not None
            self._dtypes = dtypes
        return self._dtypes

    # -- a text epoch in stages (plan/packing_stages.py) ---------------------------------------------------
    def _epoch_stages(self, epoch: int) -> Stages:
        """An epoch's stages: its row groups in the epoch's order (from the documents: known before
        counting), cut by compressed text bytes (rows where the catalog has no byte ranges)."""
        if self._stages is None or self._stages[0] != epoch:
            ds = self.source
            order = stream_order(ds.catalog.layout, ds.config, epoch)
            self._stages = (epoch, Stages.split(order, self._text_weights(), self.first_stage_bytes))
        return self._stages[1]

    def _text_weights(self, catalog: Any = None) -> np.ndarray:
        """What counting each row group costs: its compressed text bytes (rows where the catalog has no
        byte ranges); of ``catalog``, the source's by default."""
        catalog = catalog if catalog is not None else self.source.catalog
        if catalog.rg_ranges is not None and self.column in catalog.file_columns:
            span = catalog.rg_ranges[:, catalog.file_columns.index(self.column)]
            return (span[:, 1] - span[:, 0]).astype(np.float64)
        return catalog.rg_rows.astype(np.float64) * 1024  # ~1 KiB of text a document

    def _stage_counts(self) -> StageCounts:
        """The token counts, as far as counted: the cache's at first (this process's view of it)."""
        if self._counts is None:
            self._counts = self._new_counts(0)
        return self._counts

    def _new_counts(self, k: int, known: np.ndarray | None = None) -> StageCounts:
        """Corpus ``k``'s token counts: ``known`` (a pickled copy's), else the cache's (this process's view)."""
        ds = self.corpora[k]
        if known is None:  # first made here: check the column first (a pickled copy's parent did)
            self._column_dtypes()
            cache = self._count_cache(k)
            known = cache.load(ds.catalog) if cache is not None else None
        return StageCounts(ds.catalog.rg_file, partial(self._count_corpus, k), known)

    def _counts_of(self, k: int) -> StageCounts:
        """Corpus ``k``'s counts in stages (a single corpus's, or a staged blend's corpus ``k``'s)."""
        return self._stage_counts() if self._staged else self._corpus_counts()[k]

    def _count_cache(self, k: int = 0) -> TokenCountCache | None:
        assert self.text is not None
        ds = self.corpora[k]
        return TokenCountCache(ds.catalog_cache, self.text.identity, self.column) \
            if ds.catalog_cache and self.text.identity else None

    def _count_corpus(self, k: int, rgs: np.ndarray, what: str = "(a later stage of the epoch, beside training)",
                      quiet: bool = True) -> np.ndarray:
        """Count corpus ``k``'s row groups a plan needs in this process: what another worker process of
        this pack counted (``io/count_share.py``), then the cache again (another run may have counted
        them), then tokenizing what it lacks; saved for the next run."""
        assert self.text is not None
        ds, text = self.corpora[k], self.text

        def count(missing: np.ndarray) -> np.ndarray:
            return count_text_tokens(ds.catalog, ds.storage_options, self.column, text, ds.catalog_cache,
                                     quiet=quiet, rgs=missing, what=what)[missing]

        return self._shared_count(_share_name(k), rgs, ds, count)

    def _shared_count(self, name: str, rgs: np.ndarray, ds: ParquetStream,
                      count: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """``count(rgs)``, through the share when other processes of this pack may need the same counts
        (DataLoader worker processes, or their parent): one of them tokenizes, the others read."""
        if current_worker()[1] > 0 or self._count_share.may_have_workers():
            return self._count_share.counts(name, rgs, ds.catalog.num_row_groups, count)
        return count(rgs)

    def _count_first_stage(self, epoch: int) -> None:
        """Count the epoch's first stage now (split over the ranks: the same collective place as the
        catalog), then the other stages on a background thread, in order."""
        assert self.text is not None
        counts, stages = self._stage_counts(), self._epoch_stages(epoch)
        if not len(stages):
            return
        ds = self.source
        distributed = current_worker()[1] == 0 and ds._splits_catalog()
        self._count_first(0, stages.units(0), distributed, f"(the first of {len(stages)} stages of epoch {epoch})")
        place = collective.process_group(ds._catalog_group) if distributed else None
        service = rank_counting(ds._catalog_group) if place is not None else None
        if service is not None:
            # Every rank of the group is here, in the same order (the first stage was a collective): the
            # later stages are split over its ranks by the counting group's thread, in the order of these calls.
            rank, world = place
            service.add(partial(
                count_later_stages, counts=counts, stages=stages, known=partial(self._known_counts, 0),
                count_mine=partial(self._count_rank_share, 0), saved=partial(self._stage_counted, 0, cache=rank == 0),
                weights=self._text_weights(), round_weight=float(world * self.first_stage_bytes),
                claim=self._claim_for_workers(0, stages.order[stages.bounds[1]:])))
            return
        running = self._counter is not None and self._counter.is_alive()  # one at a time (an earlier epoch's goes on)
        if current_worker()[1] == 0 and not running and not counts.counted(stages.order):
            self._counter = threading.Thread(target=count_later_stages_alone, args=(counts, stages), daemon=True,
                                             name="streamshard-count-stages")
            self._counter.start()

    def _count_first(self, k: int, first: np.ndarray, distributed: bool, what: str) -> None:
        """Count corpus ``k``'s first stage ``first`` now: split over the ranks (``distributed``: every rank
        joins, whatever it holds; rank 0's view decides what is left to count), else what this process lacks."""
        assert self.text is not None
        counts, ds = self._counts_of(k), self.corpora[k]
        if distributed:
            got = count_text_tokens(ds.catalog, ds.storage_options, self.column, self.text, ds.catalog_cache,
                                    distributed=True, group=ds._catalog_group, rgs=first, known=counts.tokens,
                                    what=what)
            counts.fill(first, got[first])
        elif not counts.counted(first):
            missing = first[counts.tokens[first] < 0]
            counts.fill(missing, self._count_corpus(k, missing, what, quiet=False))

    def _known_counts(self, k: int) -> np.ndarray:
        """Corpus ``k``'s counts in this process, the cache's and its worker processes' where it has none
        (another process may have counted them)."""
        tokens, cache = self._counts_of(k).tokens.copy(), self._count_cache(k)
        if cache is not None:
            tokens = np.where(tokens >= 0, tokens, cache.load(self.corpora[k].catalog))
        if self._count_share.started():
            try:
                tokens = np.where(tokens >= 0, tokens, self._count_share.table(_share_name(k), len(tokens)))
            except (OSError, CatalogError) as exc:  # counted here instead (the split must go on in step)
                log.warning("the token counts of this rank's worker processes are not used: %s", exc)
        return tokens

    def _claim_for_workers(self, k: int, units: np.ndarray) -> Claim | None:
        """Tell this process's worker processes (now or later forked) that corpus ``k``'s ``units`` (later
        stages) are being split over the ranks here, so they wait for its counts (``_stage_counted``
        publishes them) instead of counting them too. Made when the job is added, so no worker
        started after it misses it; None where they are counted here already (the workers start from
        these counts) or it cannot be written (a warning: the workers count themselves)."""
        if not len(units) or self._counts_of(k).counted(units):
            return None
        try:
            return self._count_share.claim(_share_name(k), units)
        except OSError as exc:
            log.warning("this rank's worker processes count the later text stages themselves: no claim in %s "
                        "(%s: %s)", self._count_share.directory, type(exc).__name__, exc)
            return None

    def _stage_counted(self, k: int, tokens: np.ndarray, cache: bool) -> None:
        """A stage of corpus ``k`` split over the ranks is counted: published for this process's worker
        processes, if it has any (they may be waiting for it: first, before the cache's lock and
        rewrite), then saved to the count cache (``cache``: one rank of the group saves). Failures of
        either are warnings (the cache warns itself): the split's other ranks go on regardless."""
        if self._count_share.copied():
            try:
                self._count_share.publish(_share_name(k), tokens)
            except OSError as exc:
                log.warning("the token counts of a later text stage are not shared with this rank's worker "
                            "processes (%s: %s): they count it themselves", type(exc).__name__, exc)
        if cache:
            self._save_counts(k, tokens)

    def _count_rank_share(self, k: int, rgs: np.ndarray) -> np.ndarray:
        """Count corpus ``k``'s ``rgs`` here, alone (this rank's share of a stage split over the ranks)."""
        assert self.text is not None
        ds = self.corpora[k]
        counts = count_text_tokens(ds.catalog, ds.storage_options, self.column, self.text, None, quiet=True,
                                   rgs=rgs, what="(this rank's share of a later stage, beside training)")
        return counts[rgs]

    def _save_counts(self, k: int, tokens: np.ndarray) -> None:
        cache = self._count_cache(k)
        if cache is not None:
            cache.save(self.corpora[k].catalog, tokens)

    # -- a blend of text corpora with num_samples, in stages (plan/blend_stages.py) -------------------
    def _corpus_counts(self) -> list[StageCounts]:
        """Each corpus's token counts as far as counted (the cache's at first)."""
        if self._blend_counts is None:
            self._blend_counts = [self._new_counts(k) for k in range(len(self.corpora))]
        return self._blend_counts

    def _corpus_tokens(self) -> list[CorpusTokens | None]:
        """Each corpus's sequences located from its counts (None: a corpus the blend gives no position);
        its stages cut its epoch-0 order, the first holding its share of ``first_stage_bytes``."""
        if self._blend_tokens is None:
            assert self.blend is not None
            shares = blend_counts(self.blend.weights, self.num_sequences)
            first = corpus_first_bytes(self.first_stage_bytes, shares)
            corpora: list[CorpusTokens | None] = []
            for k, (name, ds, counts) in enumerate(zip(self.blend.names, self.corpora, self._corpus_counts())):
                if not shares[k]:
                    corpora.append(None)
                    continue
                layout, config = ds.catalog.layout, ds.config
                stages = Stages.split(stream_order(layout, config, 0), self._text_weights(ds.catalog), float(first[k]))
                corpora.append(CorpusTokens(name, stages, counts, partial(stream_order, layout, config), self.seq_len))
            self._blend_tokens = corpora
        return self._blend_tokens

    def _blend_epoch_stages(self, epoch: int) -> BlendStages:
        """Blend epoch ``epoch``'s positions in stages (their bounds found as the corpora are counted)."""
        if epoch not in self._blend_stages:
            assert self.blend is not None
            blend = BlendMap(self.blend.weights, self.num_sequences, self.blend.order, self.blend.seed, epoch)
            self._blend_stages = {epoch: BlendStages(blend, self._corpus_tokens())}  # one epoch at a time
        return self._blend_stages[epoch]

    def _count_blend_first_stage(self, epoch: int) -> None:
        """Count every corpus's first stage now (each split over the ranks, like the catalog), then the
        later stages beside training, stage by stage over the corpora: split over the ranks of the
        process group (the default one, or the data-parallel group of the corpora's ``mesh=``:
        ``streams/stage_counting.py``), else on a background thread."""
        assert self.text is not None
        corpora = self._corpus_tokens()
        distributed = current_worker()[1] == 0 and all(ds._splits_catalog() for ds in self.corpora)
        for k, corpus in enumerate(corpora):
            if corpus is not None and len(corpus.stages):  # else no positions, or no rows: nothing to count
                self._count_first(k, corpus.stages.units(0), distributed, f"(the first stage of a blend's epoch {epoch})")
        group = self.corpora[0]._catalog_group  # the default group's ranks, or a mesh's data-parallel group
        shared = distributed and all(ds._catalog_group is group for ds in self.corpora)
        place = collective.process_group(group) if shared else None
        service = rank_counting(group) if place is not None else None
        if service is not None:
            # Every rank of the group is here, in the same order: each corpus's later stages, stage i of
            # every corpus before stage i + 1 of any, are split over its ranks by the counting group's thread.
            rank, world = place
            # A corpus's claim of its later stages goes from job to job (each beats it), let go by its last.
            claims = [self._claim_for_workers(k, c.stages.order[c.stages.bounds[1]:])
                      if c is not None and len(c.stages) > 1 else None for k, c in enumerate(corpora)]
            for i in range(1, max((len(c.stages) for c in corpora if c is not None), default=0)):
                for k, corpus in enumerate(corpora):
                    if corpus is not None and i < len(corpus.stages):
                        service.add(partial(
                            count_later_stages, counts=corpus.counts, stages=_only_stage(corpus.stages, i),
                            known=partial(self._known_counts, k), count_mine=partial(self._count_rank_share, k),
                            saved=partial(self._stage_counted, k, cache=rank == 0),
                            weights=self._text_weights(self.corpora[k].catalog),
                            round_weight=float(world * self.first_stage_bytes),
                            claim=claims[k], last=i == len(corpus.stages) - 1))
            return
        running = self._counter is not None and self._counter.is_alive()
        whole = all(c is None or c.counts.counted(c.stages.order) for c in corpora)
        if current_worker()[1] == 0 and not running and not whole:
            self._counter = threading.Thread(target=_count_blend_stages, args=(corpora,), daemon=True,
                                             name="streamshard-count-blend-stages")
            self._counter.start()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_counter"] = None
        if self._counts is not None:  # a lock and a bound method do not travel: the copy starts from these counts
            state["_counts"] = None
            state["_known"] = self._counts.tokens.copy()
        if self._blend_counts is not None:  # the same, corpus by corpus
            state["_blend_counts"], state["_blend_tokens"], state["_blend_stages"] = None, None, {}
            state["_blend_known"] = [c.tokens.copy() for c in self._blend_counts]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        known = state.pop("_known", None)
        blend_known = state.pop("_blend_known", None)
        self.__dict__.update(state)
        if known is not None:
            self._counts = self._new_counts(0, known)
        if blend_known is not None:
            self._blend_counts = [self._new_counts(k, tokens) for k, tokens in enumerate(blend_known)]

    def _count_text(self, name: str, ds: ParquetStream) -> np.ndarray:
        """Tokens per row group of one of a blend's text corpora: split over the ranks where they form a
        process group, else counted once for this pack's worker processes (``name``: its counts' file
        name in the share, not the corpus's name, which may hold any character)."""
        assert self.text is not None
        text = self.text

        def count(rgs: np.ndarray | None = None, distributed: bool = False) -> np.ndarray:
            return count_text_tokens(ds.catalog, ds.storage_options, self.column, text, ds.catalog_cache,
                                     distributed=distributed, group=ds._catalog_group, rgs=rgs)

        if current_worker()[1] == 0 and ds._splits_catalog() and collective.process_group(ds._catalog_group):
            return count(distributed=True)
        every = np.arange(ds.catalog.num_row_groups, dtype=np.int64)
        return self._shared_count(name, every, ds, lambda missing: count(missing)[missing])

    def _check_columns(self, schema: pa.Schema, where: str) -> dict[str, np.dtype]:
        """Every packed column must be a list of numbers (a text column: a string); their dtypes, for padding batches."""
        if self.text is not None:
            if self.column not in schema.names:
                raise ValueError(f"column {self.column!r} is not in {where}'s columns {schema.names}")
            t = schema.field(self.column).type
            if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)):
                raise ValueError(f"column {self.column!r} is {t}; with tokenizer= PackedStream tokenizes a string "
                                 "column (a column of token lists is packed without tokenizer=)")
            return {TOKENS: np.dtype(np.int64)}
        dtypes = {}
        for name in self.columns:
            if name not in schema.names:
                raise ValueError(f"column {name!r} is not in {where}'s columns {schema.names}")
            t = schema.field(name).type
            if not (pa.types.is_list(t) or pa.types.is_large_list(t)) or not (
                    pa.types.is_integer(t.value_type) or pa.types.is_floating(t.value_type) or pa.types.is_boolean(t.value_type)):
                raise ValueError(f"column {name!r} is {t}; PackedStream packs lists of numbers (other columns are "
                                 "not read: leave them out of columns=)")
            dtype = np.dtype(t.value_type.to_pandas_dtype())
            dtypes[name] = np.dtype(np.int64) if dtype.kind == "u" and dtype != np.uint8 else dtype  # torch lacks most uints
        return dtypes


_NO_STEERING = ("set_weights on a packed blend of text corpora with num_samples is not supported: its positions are "
                "planned in stages as the corpora are counted, and changing weights needs every corpus's sequence "
                "count (a blend without num_samples, counted whole first, can be steered)")


def _share_name(k: int) -> str:
    """The name of corpus ``k``'s counts in the pack's count share (by index: a corpus's name may hold any
    character, and a single corpus is corpus 0)."""
    return f"corpus-{k}"


def _only_stage(stages: Stages, i: int) -> Stages:
    """Stage ``i`` of ``stages`` as the one later stage (stage 1) of a ``Stages`` of its own, for
    ``stage_counting.count_later_stages`` (which counts stages 1.. of what it is given; its log then
    says "stage 1 of 2")."""
    units = stages.units(i)
    return Stages(units, np.array([0, 0, len(units)], dtype=np.int64))


def _count_blend_stages(corpora: list[CorpusTokens | None]) -> None:
    """A background thread's work: every corpus's stage 1, then every corpus's stage 2, ... (blend stage
    ``i`` needs stage ``i`` of each corpus); a failure is left for training to meet when it gets there."""
    stages = max((len(c.stages) for c in corpora if c is not None), default=0)
    for i in range(1, stages):
        for corpus in corpora:
            if corpus is not None and i < len(corpus.stages):
                try:
                    corpus.counts.of(corpus.stages.units(i))
                except Exception as exc:  # noqa: BLE001 - training counts the stage itself when it gets there
                    if threading.main_thread().is_alive():
                        log.warning("counting stage %d of corpus %r in the background failed (%s: %s); it is "
                                    "counted when training reaches it", i, corpus.name, type(exc).__name__, exc)
                    return


def _in_document_order(lengths: np.ndarray, values: dict[str, np.ndarray], rg: int, documents: EpochPlan) -> TokenGroup:
    """Row group ``rg``'s tokens (rows of ``lengths`` tokens end to end in ``values``, file order) laid out
    in the epoch's document order."""
    starts = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1], out=starts[1:])
    order = documents.rows_at(np.full(len(lengths), rg, dtype=np.int64), np.arange(len(lengths), dtype=np.int64))
    return token_group(lengths, starts, values, order)


def cu_seqlens(position_ids: torch.Tensor) -> torch.Tensor:
    """Segment start offsets of a packed batch, flattened, plus the total: ``cu_seqlens`` for varlen
    attention kernels (int32). A segment starts wherever ``position_ids == 0`` (each document, each
    continuation at a sequence start, each padding token)."""
    bounds = segment_bounds(position_ids.detach().cpu().numpy())
    return torch.from_numpy(bounds).to(position_ids.device)
