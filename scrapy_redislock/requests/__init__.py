"""The request front: requests in flight per stage (:class:`StageLockMiddleware` and
:class:`StageScheduler`)."""
