"""Raw text to token ids for ``PackedStream(tokenizer=...)``: one adapter over the tokenizers people use.

Three kinds are accepted, told apart by what they have (no transformers import):

* a Hugging Face ``tokenizers.Tokenizer`` (has ``encode_batch`` and ``to_str``): used directly with
  ``encode_batch(texts, add_special_tokens=False)``, which runs in Rust without the GIL, so read-ahead
  threads tokenize beside training;
* a transformers *fast* tokenizer (has ``backend_tokenizer``, a ``tokenizers.Tokenizer``): its backend
  is used as above;
* any callable ``list[str] -> list[list[int]]``: called as is; it holds the GIL (Python), so
  ``StreamLoader(workers="auto")`` runs its passes in worker processes.

Special tokens are never added silently: a ``tokenizers.Tokenizer`` whose post-processor would add
BOS/EOS (``TemplateProcessing``, BERT's ``[CLS]``/``[SEP]``) is called with ``add_special_tokens=False``;
``bos_id``/``eos_id`` put one token before/after every document, and a callable's output is taken
exactly as it returns it (plus ``bos_id``/``eos_id``). A null text is no document (zero tokens, no
BOS/EOS); an empty string is a document of just its BOS/EOS, if any.

``identity`` names the tokenizer for the token count cache (``io/token_count_cache.py``): the SHA-256
of a ``tokenizers.Tokenizer``'s serialized JSON (vocabulary, merges, normalizer, pre-tokenizer: what
decides the ids), with ``bos_id``/``eos_id``; a callable has one only when the user names it
(``tokenizer_name=``), since its code cannot be hashed honestly.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from typing import Any, Sequence

import numpy as np

from ..errors import ConversionError


class TextTokenizer:
    """What ``PackedStream`` calls to turn a row group's texts into token ids (picklable: workers get a copy)."""

    def __init__(self, tokenizer: Any, bos_id: int | None = None, eos_id: int | None = None,
                 name: str | None = None) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)  # a transformers fast tokenizer
        if backend is not None and _is_hf_tokenizer(backend):
            tokenizer = backend
        for label, value in (("bos_id", bos_id), ("eos_id", eos_id)):
            if value is not None and (not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0):
                raise ValueError(f"{label} must be a token id (int >= 0) or None, got {value!r}")
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"tokenizer_name must be a non-empty str or None, got {name!r}")
        self.hf = _is_hf_tokenizer(tokenizer)
        if not self.hf and not callable(tokenizer):
            raise ValueError("tokenizer must be a tokenizers.Tokenizer, a transformers fast tokenizer or a callable "
                             f"list[str] -> list[list[int]]; got {type(tokenizer).__name__}")
        self.tokenizer = tokenizer
        self.bos_id = None if bos_id is None else int(bos_id)
        self.eos_id = None if eos_id is None else int(eos_id)
        self.name = name
        self.identity = self._identity()

    @property
    def releases_gil(self) -> bool:
        """Whether tokenizing can run on threads beside training (HF ``encode_batch`` runs in Rust)."""
        return self.hf

    def _identity(self) -> str | None:
        if self.hf:
            what = hashlib.sha256(self.tokenizer.to_str().encode()).hexdigest()
        elif self.name is not None:
            what = f"name:{self.name}"
        else:
            return None
        return json.dumps({"tokenizer": what, "bos_id": self.bos_id, "eos_id": self.eos_id}, sort_keys=True)

    def encode(self, texts: Sequence[str | None], where: str) -> tuple[np.ndarray, np.ndarray]:
        """``(lengths, ids)``: each text's token count (0 for a null) and all ids end to end (int64),
        BOS/EOS included. ``where`` names the row group in errors (a callable returning the wrong shape)."""
        present = [t for t in texts if t is not None]
        if self.hf:
            encoded = [e.ids for e in self.tokenizer.encode_batch(present, add_special_tokens=False)]
        else:
            encoded = self.tokenizer(present)
            if not isinstance(encoded, Sequence) or len(encoded) != len(present):
                raise ConversionError(f"{where}: the tokenizer returned {type(encoded).__name__} of "
                                      f"{len(encoded) if isinstance(encoded, Sequence) else '?'} items for "
                                      f"{len(present)} texts; it must return one list of ids per text")
        extra = (self.bos_id is not None) + (self.eos_id is not None)
        inner = np.fromiter((len(ids) for ids in encoded), dtype=np.int64, count=len(encoded))
        lengths = np.zeros(len(texts), dtype=np.int64)
        lengths[[i for i, t in enumerate(texts) if t is not None]] = inner + extra
        if not extra:
            docs: Any = encoded
        else:
            head = [self.bos_id] if self.bos_id is not None else []
            tail = [self.eos_id] if self.eos_id is not None else []
            docs = (itertools.chain(head, ids, tail) for ids in encoded)
        total = int(lengths.sum())
        try:
            ids = np.fromiter(itertools.chain.from_iterable(docs), dtype=np.int64, count=total)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ConversionError(f"{where}: the tokenizer returned something other than lists of int ids "
                                  f"({type(exc).__name__}: {exc})") from exc
        if total and ids.min() < 0:
            raise ConversionError(f"{where}: the tokenizer returned a negative token id ({int(ids.min())})")
        return lengths, ids

    def count(self, texts: Sequence[str | None], where: str) -> int:
        """Tokens of ``texts`` as ``encode`` lays them out (what the plan balances by); an HF tokenizer's
        ids are not copied out (``len`` of each encoding)."""
        if not self.hf:
            return int(self.encode(texts, where)[0].sum())
        present = [t for t in texts if t is not None]
        extra = (self.bos_id is not None) + (self.eos_id is not None)
        encoded = self.tokenizer.encode_batch(present, add_special_tokens=False)
        return sum(len(e) for e in encoded) + extra * len(present)


def _is_hf_tokenizer(obj: Any) -> bool:
    return callable(getattr(obj, "encode_batch", None)) and callable(getattr(obj, "to_str", None))

