from scheduler.scheduler import (
    PREEMPTION_MODES,
    PreemptionMode,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)

__all__ = ["PREEMPTION_MODES", "PreemptionMode", "Scheduler", "SchedulerConfig", "SchedulerOutput"]
