"""qcowfs's Python test helpers, one package for the integration tests, the
hostile-image corpus and the fuzz seeds:

  helpers          running qcowfs and QEMU's tools, mounts, comparisons
  format_helpers   per-format image building and checks of the integration tests
  create_helpers   `qcowfs create` beside `qemu-img create`
  qcow2_meta       the qcow2 metadata reader and editor (header, extensions,
                   snapshots, L1/L2, refcounts)
  qcow2_matrix     the qcow2 images of the read tests, one per option set
  vhdx_edit        the VHDX metadata editor
  hostile, hostile_FMT   the hostile-image corpus (python3 -m qcowfs_testlib.hostile OUT)

Importable as `qcowfs_testlib` with tests/ on the module path: tests/pytest.ini
puts it there for pytest, tests/CMakeLists.txt sets PYTHONPATH for the ctest
entries and the corpus generation.
"""
