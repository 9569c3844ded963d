"""Gradient store: groups of `GradientRecord` s plus an index ``identifier → occurrences``.

A *group* is one unit of writing (one `GradientStorageManager.save` /
`GradientStorageManager.save_bulk` call) holding one or more records. The index
maps every sample identifier (content hash or ``sample_id_key`` value) to its
occurrences ``{"file": location, "idx": record position, "step": int,
"sample_idx": row}``; each (step, identifier) pair is held once, the newest
save replacing earlier ones.

On-disk layout of a ``"disk"`` store (the reference design's format 2; the write
directory is ``save_dir``, or ``save_dir/rank_<r>/`` under a process group)::

    index_meta.json          {"format": 2, "sample_id_key", "gradient_accumulation_steps"}
    ranks.json               rank directories only: {"rank": r, "world_size": n}
    projection.json          the declared capture projection (`projection_record`), if any
    index.jsonl              one compact line per group:
                             {"file": handle, "records": [{"idx", "step", "hashes"}, ...]}
    batch_<NNNNNN>.mmap.bin  save_bulk memmap group: raw tensor bytes, 8-byte aligned parts
    batch_<NNNNNN>.mmap.meta torch.save'd {"format": 2, "records": [...]} (part specs)
    batch_<NNNNNN>.pt        save_bulk pickle group: torch.save(list of GradientRecord)
    step_<step>_<id>.*       save() groups (identifier made file-system safe)

Handles (``file`` of the index) are paths relative to ``save_dir``; a memmap
group's handle is ``<base>.mmap`` (backed by ``.mmap.bin`` + ``.mmap.meta``).

Completeness: a rank directory's ``ranks.json`` records the world size of the
run that wrote it. Reading a store in which some indexed rank directory
declares world size ``n`` needs an indexed ``rank_0 .. rank_{n-1}``; a missing
one makes every read raise `ValueError` naming it (a partial score would be
silent). Stores without ``ranks.json`` (the reference design's) are read as
they are.

Crash safety: group files and sidecars are written under a temporary name,
fsynced and renamed *before* the group's log line is appended (and fsynced),
so a killed writer leaves at most an unindexed file or a truncated last log
line, which readers ignore with a `UserWarning`. Auto-named group files are
claimed with an exclusive create, so writers sharing a directory never
overwrite each other's groups.

Reading never runs code from the files: pickle groups and ``.mmap.meta`` files
load with ``torch.load(weights_only=True)``, only this library's record classes
allowed besides tensors and plain containers.

The parts, one job each: `format` (the group files' codec), `index` (the log
and the live index), `sidecars` (store-wide settings and their files), `ranks`
(rank directories and completeness) and `residency` (disk or RAM homes of the
groups). The front that composes them, `GradientStorageManager`, lives at its
public path ``dattri_llm.gradient.storage_manager`` (where the process rank is
looked up, so that patching ``storage_manager.dist_rank`` reaches the store),
beside `AsyncGradientWriter` in ``dattri_llm.gradient.async_writer``.
"""
