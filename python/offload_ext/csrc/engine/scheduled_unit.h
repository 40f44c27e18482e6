// ScheduledUnit: what the step scheduler keeps of one unit: its span, its parameter groups, and the counts
// its waits and its choice of the next job read. Guarded by the scheduler's lock.
#pragma once

#include <cstdint>
#include <vector>

#include "../kernels/adamw_unit.h"
#include "job.h"

namespace offload_ext {

struct ScheduledUnit {
  StepUnit span;
  std::vector<GroupRange> groups;  // contiguous, in order, covering the span
  int64_t expected = 0;  // jobs announced (expect(), and the moments passes split off)
  int64_t stepped = 0;   // jobs done (or skipped after a failure)
  int trailing = 0;      // moments passes queued or running (each its unit's last job)
  int waiters = 0;         // callers blocked in wait()
  int params_waiters = 0;  // callers blocked in wait(params_only), whom its moments keep not
  double sq_norm = 0.0;  // the last norm job's result
  bool swapped = false;  // the live state is in the second buffers (an odd number of speculative steps so far)

  // Whether a caller is blocked on the unit (on its params alone, or on all of it).
  bool waited() const { return waiters > 0 || params_waiters > 0; }
  // Whether every announced job is done. A moments pass is its unit's last job until the unit's next step is
  // announced, which comes after the next forward's copy: with `params_only` the params are final once every
  // job but those is done.
  bool done(bool params_only) const { return stepped + (params_only ? trailing : 0) >= expected; }
  // A speculative step ran (or was dropped as if it had): the second buffers hold the live state.
  void swap() {
    swap_state(span);
    swapped = !swapped;
  }
};

}  // namespace offload_ext
