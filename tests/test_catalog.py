"""The instance catalog: the shipped snapshot, SkyPilot's vms.csv format, sources and atomic writes."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from providers.base import Offer
from providers.catalog import (CATALOG_PROVIDERS, CatalogError, catalog_sources, load_offers, read_offers,
                               snapshot_dir, write_offers)

# Rows in the formats of skypilot-org/skypilot-catalog's files (AWS v7: GpuInfo, no Arch column; GCP v7:
# the GPU priced on a row of its own; Azure v6: no zone).
AWS = """InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,GpuInfo,Price,SpotPrice,Region,AvailabilityZone
p5.48xlarge,H100,8.0,192.0,2048.0,"{'Gpus': [{'Name': 'H100', 'Manufacturer': 'NVIDIA', 'Count': 8, 'MemoryInfo': {'SizeInMiB': 81920}}], 'TotalGpuMemoryInMiB': 655360}",98.32,30.326000,us-east-1,use1-az1
p4de.24xlarge,A100-80GB,8.0,96.0,1152.0,"{'Gpus': [{'Name': 'A100-80GB', 'Manufacturer': 'NVIDIA', 'Count': 8, 'MemoryInfo': {'SizeInMiB': 81920}}], 'TotalGpuMemoryInMiB': 655360}",40.96575,,us-east-1,use1-az4
p4de.24xlarge,A100-80GB,8.0,96.0,1152.0,"{'Gpus': [{'Name': 'A100', 'Manufacturer': 'NVIDIA', 'Count': 8, 'MemoryInfo': {'SizeInMiB': 81920}}], 'TotalGpuMemoryInMiB': 655360}",40.96575,7.807400,us-east-1,use1-az4
p5e.48xlarge,H200,8.0,192.0,2048.0,"{'Gpus': [{'Name': 'H200', 'Manufacturer': 'NVIDIA', 'Count': 8, 'MemoryInfo': {'SizeInMiB': 144384}}], 'TotalGpuMemoryInMiB': 1155072}",,16.389500,us-east-2,use2-az1
m5.large,,,2.0,8.0,,0.096,0.0357,us-east-1,use1-az1
"""
GCP = """InstanceType,vCPUs,MemoryGiB,AcceleratorName,AcceleratorCount,GpuInfo,Region,AvailabilityZone,Price,SpotPrice
a3-highgpu-4g,104.0,936.0,,,,us-central1,us-central1-a,4.73003,1.08774
a2-highgpu-8g,96.0,680.0,,,,us-central1,us-central1-a,5.91582,2.36604
,,,H100,4,{'Gpus': [{'MemoryInfo': {'SizeInMiB': 81920}}]},us-central1,us-central1-a,16.80304,9.012
,,,A100,8,{'Gpus': [{'MemoryInfo': {'SizeInMiB': 40960}}]},us-central1,us-central1-a,23.47126,9.1776
,,,A100,8,{'Gpus': [{'MemoryInfo': {'SizeInMiB': 40960}}]},us-west3,us-west3-b,27.49491,10.9704
"""
AZURE = """InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,GpuInfo,Price,SpotPrice,Region,Generation
Standard_NC24ads_A100_v4,A100-80GB,1,24.0,220,A100-80GB,3.673,0.444433,eastus,V2
Standard_NC6s_v3,V100,1,6.0,112,V100,3.06,0.3978,eastus,"V1,V2"
"""


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_the_shipped_snapshot_has_gpu_offers_of_each_cloud_with_a_cited_source():
    offers = load_offers()
    for provider in CATALOG_PROVIDERS:
        mine = [o for o in offers if o.provider == provider]
        assert mine, provider
        assert all(o.price > 0 and o.accelerator and o.accelerator_count >= 1 for o in mine)
        assert all(o.accelerator_memory_gib >= 16 for o in mine)
    source = (snapshot_dir() / "SOURCE.md").read_text()
    assert "skypilot-org/skypilot-catalog" in source and "001367d22a0033fac286a8c71aeac7109e431bcb" in source


def test_skypilot_aws_rows_by_column_name_with_duplicates_merged_and_unpriced_rows_skipped(tmp_path):
    offers = {o.instance_type: o for o in read_offers(_write(tmp_path / "aws" / "vms.csv", AWS))}
    assert set(offers) == {"p5.48xlarge", "p4de.24xlarge", "m5.large"}      # p5e has no on-demand price
    p5 = offers["p5.48xlarge"]
    assert (p5.provider, p5.accelerator, p5.accelerator_count, p5.accelerator_memory_gib) == ("aws", "H100", 8, 80.0)
    assert (p5.price, p5.spot_price, p5.zone, p5.arch) == (98.32, 30.326, "use1-az1", "x86_64")
    assert offers["p4de.24xlarge"].spot_price == 7.8074                     # the duplicate row's spot price is kept
    assert (offers["m5.large"].accelerator, offers["m5.large"].accelerator_count) == (None, 0)


def test_skypilot_gcp_gpu_rows_are_priced_on_top_of_their_host(tmp_path):
    offers = read_offers(_write(tmp_path / "gcp.csv", GCP))
    gpu = {o.instance_type: o for o in offers if o.accelerator}
    assert set(gpu) == {"a3-highgpu-4g", "a2-highgpu-8g"}                    # us-west3 has no host row: dropped
    h100 = gpu["a3-highgpu-4g"]
    assert (h100.accelerator, h100.accelerator_count, h100.accelerator_memory_gib) == ("H100", 4, 80.0)
    assert h100.price == pytest.approx(4.73003 + 16.80304) and h100.spot_price == pytest.approx(1.08774 + 9.012)
    assert gpu["a2-highgpu-8g"].price == pytest.approx(5.91582 + 23.47126)


def test_azure_rows_have_no_zone_and_take_gpu_memory_from_the_vendor_table(tmp_path):
    offers = {o.instance_type: o for o in read_offers(_write(tmp_path / "azure.csv", AZURE))}
    assert offers["Standard_NC24ads_A100_v4"].zone is None
    assert offers["Standard_NC24ads_A100_v4"].accelerator_memory_gib == 80
    assert offers["Standard_NC6s_v3"].accelerator_memory_gib == 16


@pytest.mark.parametrize("text, message", [
    ("InstanceType,Region\nx,r\n", ":1: missing column 'Price'"),
    ("InstanceType,Region,Price\nx,r,cheap\n", ":2: Price: 'cheap' is not a number"),
    ("InstanceType,Region,Price\nx,r,1.0,extra\n", ":2: more fields than the header has columns"),
    ("InstanceType,Region,Price,vCPUs\nx,r,1.0,-4\n", ":2: vCPUs: '-4' must be a finite number >= 0"),
])
def test_a_malformed_catalog_names_file_line_and_column(tmp_path, text, message):
    path = _write(tmp_path / "aws.csv", text)
    with pytest.raises(CatalogError) as err:
        read_offers(path)
    assert str(err.value).startswith(str(path)) and message in str(err.value)


def test_write_then_read_round_trips_every_field_and_leaves_no_temp_file(tmp_path):
    offers = [Offer("aws", "us-east-1", "use1-az1", "p5.48xlarge", "H100", 8, 80.0, 192.0, 2048.0, 98.32, 30.3,
                    "EFA 3200 Gbps"),
              Offer("azure", "eastus", None, "Standard_NC6s_v3", "V100", 1, 16.0, 6.0, 112.0, 3.06, None),
              Offer("gcp", "us-central1", "us-central1-a", "n2-standard-8", None, 0, 0.0, 8.0, 32.0, 0.39, 0.1,
                    arch="arm64")]
    path = tmp_path / "cache" / "mixed.csv"
    write_offers(path, offers[:1])
    write_offers(path, offers)                                            # replaces the file atomically
    assert sorted(read_offers(path), key=lambda o: o.provider) == offers
    assert os.listdir(path.parent) == ["mixed.csv"]


def test_a_refreshed_cache_overrides_the_snapshot_for_its_provider_only(tmp_path, monkeypatch):
    monkeypatch.setenv("TFSN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    write_offers(tmp_path / "cache" / "catalog" / "gcp.csv",
                 [Offer("gcp", "us-central1", "us-central1-a", "a3-highgpu-8g", "H100", 8, 80.0, 208, 1872, 88.0)])
    sources = catalog_sources()
    assert sources["gcp"] == tmp_path / "cache" / "catalog" / "gcp.csv"
    assert sources["aws"] == snapshot_dir() / "aws.csv"
    gcp = load_offers("gcp")
    assert [(o.instance_type, o.price) for o in gcp] == [("a3-highgpu-8g", 88.0)]
    assert any(o.provider == "aws" for o in load_offers())


def test_skypilots_local_catalog_is_read_when_present(tmp_path, monkeypatch):
    monkeypatch.setenv("TFSN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HOME", str(tmp_path))
    _write(tmp_path / ".sky" / "catalogs" / "v6" / "aws" / "vms.csv", AWS.replace("98.32", "1.0"))
    _write(tmp_path / ".sky" / "catalogs" / "v7" / "aws" / "vms.csv", AWS)
    assert catalog_sources("aws")["aws"] == tmp_path / ".sky" / "catalogs" / "v7" / "aws" / "vms.csv"
    assert {o.instance_type: o.price for o in load_offers("aws")}["p5.48xlarge"] == 98.32


def test_a_path_reads_one_file_or_a_folder_and_names_providers_by_file(tmp_path):
    _write(tmp_path / "cat" / "aws" / "vms.csv", AWS)
    _write(tmp_path / "cat" / "azure.csv", AZURE)
    offers = load_offers(path=tmp_path / "cat")
    assert {o.provider for o in offers} == {"aws", "azure"}
    assert {o.provider for o in load_offers("azure", path=tmp_path / "cat")} == {"azure"}
    with pytest.raises(CatalogError, match="no such file or folder"):
        load_offers(path=tmp_path / "missing.csv")
