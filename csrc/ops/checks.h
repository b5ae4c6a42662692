// Argument checks shared by the op glue: each error names the argument, what was expected and what came.
#pragma once
#include <ATen/ATen.h>

#define FD_CHECK_DTYPE(t, dt)                                                                       \
  TORCH_CHECK((t).scalar_type() == (dt), "fastdist: '" #t "' must have dtype ", (dt), ", got ", \
              (t).scalar_type())
#define FD_CHECK_DIM_AT_LEAST(t, d)                                                                   \
  TORCH_CHECK((t).dim() >= (d), "fastdist: '" #t "' must have at least ", (d), " dimension(s), got shape ", \
              (t).sizes())
#define FD_CHECK_DIM(t, d) \
  TORCH_CHECK((t).dim() == (d), "fastdist: '" #t "' must have ", (d), " dimension(s), got shape ", (t).sizes())
#define FD_CHECK_SAME_DEVICE(a, b)                                                                           \
  TORCH_CHECK((a).device() == (b).device(), "fastdist: '" #a "' and '" #b "' must be on the same device, got ", \
              (a).device(), " and ", (b).device())
