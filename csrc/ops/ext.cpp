// fastdist._C: a Python module whose only job is to load this library, so that the
// TORCH_LIBRARY_FRAGMENT(fastdist, ...) blocks of each op family register torch.ops.fastdist.*.
#include <Python.h>

PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "fastdist's C++/CUDA ops", -1, nullptr};
  return PyModule_Create(&module_def);
}
