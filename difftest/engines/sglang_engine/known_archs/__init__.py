"""The model classes difftest runs, registered with SGLang's ModelRegistry up front.

SGLang's registry imports every module under sglang.srt.models at its own import (about 200;
1.4 s on a 2-core host) unless SGLANG_EXTERNAL_MODEL_PACKAGE names a package to register
instead, its documented fast-startup path: the registry then resolves the architectures that
package registers without importing the rest, and loads SGLang's defaults for any other one
(registry.py `resolve_model_cls`). Each module here re-exports SGLang's own EntryClass, so an
architecture resolves to the same class either way.
"""
