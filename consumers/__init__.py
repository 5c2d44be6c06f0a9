"""RQ consumers: the job that sends one sample to an engine, the engine choice and client,
the worker class and its pool. (The writer, which consumes no RQ job, is the `writer` stage.)"""
