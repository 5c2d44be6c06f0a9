"""RQ consumers: the job that sends one sample to SGLang, the worker class, the writer."""
