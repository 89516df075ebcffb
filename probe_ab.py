"""Probe (not kept): bench_serving with the export and import steps of HEAD (arm "old",
one gather / scatter / checksum a row and pool) or of the working tree (arm "new")."""
import sys
arm, argv = sys.argv[1], sys.argv[2:]
if arm == "old":
    import probe_kv_io_old as old
    import drafter.programs as programs
    programs.import_step, programs.export_step = old.import_step, old.export_step
sys.path.insert(0, "benchmarks")
from benchmarks import bench_serving
bench_serving.main(argv)
